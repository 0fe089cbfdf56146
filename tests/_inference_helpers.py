"""Shared pieces of the inference tests: tiny checkpoints, transformers references, greedy
comparison with the near-tie rule, and a small synchronous HTTP client for raw route checks."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

#: The default tiny model: Qwen2 (q/k/v biases), GQA 4 heads / 2 KV heads, untied embeddings.
TINY = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    # Large enough that logits are not flat, so greedy choices are rarely near ties.
    "initializer_range": 0.2,
}
VOCAB = TINY["vocab_size"]
#: Below this top-2 logit gap in transformers' reference, either token is accepted.
NEAR_TIE = 1e-4


def hf_config(**overrides: Any):
    """A transformers config of the tiny model with ``overrides``."""
    cfg = {**TINY, **overrides}
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def make_checkpoint(path, seed: int, **overrides: Any) -> str:
    """Save a randomly initialised tiny model (float32) as an HF directory; returns the path."""
    config = hf_config(**overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path))
    return str(path)


def load_hf(path: str):
    """The transformers model of a checkpoint, float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Teacher-forced logits ``[len(tokens), vocab]`` of one sequence."""
    return model(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` (no EOS: random weights would stop at random places)."""
    ids = torch.tensor([prompt])
    # An explicit mask: generate would otherwise treat prompt tokens equal to pad_token_id as padding.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def top2_gap(logits: torch.Tensor) -> float:
    """Gap between the two largest entries of a logit row."""
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare_greedy(model, prompt: list[int], ours: list[int], resume) -> tuple[list[int], int]:
    """Compare our greedy tokens with transformers' from ``prompt``, by the near-tie rule.

    At the first difference, transformers' top-2 gap at that step must be below `NEAR_TIE`;
    then ``resume(prefix, n)`` (our engine, greedy, ``n`` tokens from ``prefix``) continues from
    transformers' choice and the comparison goes on. Returns (reference tokens, near ties seen).
    Raises AssertionError at a real difference.
    """
    n, ours = len(ours), list(ours)
    ref = hf_greedy(model, prompt, n)
    ties = 0
    for i in range(n):
        if ours[i] == ref[i]:
            continue
        gap = top2_gap(hf_logits(model, prompt + ref[:i])[-1])
        assert gap < NEAR_TIE, (f"greedy token {i} differs: ours {ours[i]} vs transformers {ref[i]} "
                                f"with a top-2 gap of {gap:.3g} (not a near tie); ours={ours} ref={ref}")
        ties += 1
        rest = list(resume(prompt + ref[: i + 1], n - i - 1)) if i + 1 < n else []
        ours = [*ours[:i], ref[i], *rest]
    return ref, ties


def http(method: str, url: str, body: Any = None, key: str | None = None,
         timeout: float = 60.0) -> tuple[int, Any]:
    """One plain HTTP request; returns (status, parsed JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
