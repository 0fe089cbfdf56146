"""Per-request sampling over a batch of logits: greedy, temperature, top-k, top-p, stop tokens.

What the log-probability means: for every sampled token we report
``log_softmax(logits / temperature)[token]`` (temperature 1 for greedy), computed *before* top-k,
top-p and the min_new_tokens stop-token mask. That is the quantity an RL trainer recomputes from
its own logits (``log_softmax(logits / T)``), so the two can be compared token by token; the
truncations only decide which token is drawn.

Rows of one batch may mix settings; everything is one vectorised pass, no loop per row except
building the small per-row parameter tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SamplingParams", "sample"]


@dataclass
class SamplingParams:
    """How one sequence is sampled (the server's copy of `GenerationHyperparameters`).

    ``temperature == 0`` means greedy. Generation stops after ``max_new_tokens`` tokens or at a
    token of ``stop_token_ids`` (which is kept in the output); stop tokens cannot be drawn before
    ``min_new_tokens`` tokens exist.
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 100_000_000
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0 or not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            raise ValueError(
                f"sampling needs 0 <= min_new_tokens ({self.min_new_tokens}) <= "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 1:
            raise ValueError(f"sampling top_k must be >= 1, got {self.top_k}")
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0:
            self.greedy = True

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> SamplingParams:
        """Build from the ``sampling_params`` object of a ``/generate`` body (see docs/http.md);
        unknown keys raise ValueError naming them."""
        names = {
            "max_new_tokens",
            "min_new_tokens",
            "greedy",
            "temperature",
            "top_p",
            "top_k",
            "stop_token_ids",
        }
        unknown = sorted(set(body) - names)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s) {unknown}; known: {sorted(names)}")
        return cls(**{k: (list(map(int, v)) if k == "stop_token_ids" else v) for k, v in body.items()})


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    num_generated: list[int],
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` ``[B, vocab]`` (float32).

    ``num_generated[b]`` is how many tokens row b already has (for ``min_new_tokens``). Returns
    ``(tokens [B] int64, logprobs [B] float32)``; see the module docstring for the logprob.
    """
    B, V = logits.shape
    if len(params) != B or len(num_generated) != B:
        raise ValueError(
            f"sample: {B} rows of logits but {len(params)} params and {len(num_generated)} counts"
        )
    dev = logits.device
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
    scaled = logits / temps.unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    masked = scaled
    blocked = [
        (b, p.stop_token_ids)
        for b, p in enumerate(params)
        if p.stop_token_ids and num_generated[b] < p.min_new_tokens
    ]
    if blocked:
        masked = scaled.clone()
        for b, ids in blocked:
            masked[b, torch.tensor([i for i in ids if 0 <= i < V], dtype=torch.long, device=dev)] = -torch.inf
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    tokens = masked.argmax(dim=-1)
    if not bool(greedy.all()):
        top_k = torch.tensor([min(p.top_k, V) for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        sorted_logits, order = masked.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=dev).unsqueeze(0)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        keep = (rank < top_k.unsqueeze(1)) & ((before < top_p.unsqueeze(1)) | (rank == 0))
        sorted_logits = sorted_logits.masked_fill(~keep, -torch.inf)
        choice = torch.multinomial(torch.softmax(sorted_logits, dim=-1), 1, generator=generator)
        drawn = order.gather(1, choice).squeeze(1)
        tokens = torch.where(greedy, tokens, drawn)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
