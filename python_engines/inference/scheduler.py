"""Continuous batching: sequences join and leave the running batch at step boundaries.

Why this shape: a weight update must land *between* two forward passes, never inside one, and
an RL rollout server must keep every slot busy while long and short generations mix. So the
server's engine loop alternates "handle control commands" and `Scheduler.step`; each step

1. admits waiting sequences into free KV-cache slots (up to ``max_running``), unless paused;
2. feeds every running sequence the tokens whose keys are not cached yet (``cached_len`` ..
   end): a new sequence feeds its whole prompt (prefill), a running one its last token
   (decode), in at most two forward calls (one padded prefill block, one ``[B, 1]`` decode);
3. samples one token per sequence, tags it with the weight version of this step, and retires
   finished sequences (their slots are free for the next step).

After a weight update the caller invokes `invalidate_cache`: every running sequence then feeds
its prompt *and* output so far again, so later tokens come from the new weights only (no keys
computed by the old weights survive). `interrupt_all` ends every sequence with stop reason
``"interrupt"`` (what ``/pause_generation`` does); the client resubmits with the output so far.

The counters in `metrics` are the evidence the tests read: ``forward_tokens`` equals prompt
tokens plus one per decode step per sequence when the KV cache works, and
``decode_batch_hist`` shows how many sequences shared each decode step.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from python_engines.inference.kv_cache import SlotAllocator
from python_engines.inference.sampling import SamplingParams, sample

__all__ = ["ForwardFn", "Scheduler", "Sequence"]

#: ``forward(tokens [B, T], positions [B, T], write_slots [B, T], read_slots [B],
#: logit_index [B]) -> logits [B, vocab]`` float32, run on every TP rank.
ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Sequence:
    """One sequence being generated; ``on_finish(seq)`` is called once when it leaves."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    on_finish: Callable[[Sequence], None]
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    error: str | None = None
    slot: int | None = None
    cached_len: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def all_tokens(self) -> list[int]:
        """Prompt followed by the output so far."""
        return self.prompt + self.output_tokens

    def to_json(self) -> dict:
        """The ``outputs[i]`` object of a ``/generate`` answer (docs/http.md)."""
        end = self.last_token_time or time.monotonic()
        return {
            "output_tokens": self.output_tokens,
            "output_logprobs": self.output_logprobs,
            "output_versions": self.output_versions,
            "stop_reason": self.stop_reason,
            "ttft": None if self.first_token_time is None else self.first_token_time - self.arrival,
            "latency": end - self.arrival,
            "itl": self.itl,
        }


class Scheduler:
    """Waiting queue, running batch and the step function; see the module docstring.

    Not thread-safe: only the engine loop calls it.
    """

    def __init__(
        self,
        forward: ForwardFn,
        num_slots: int,
        max_seq_len: int,
        scratch_slot: int,
        max_running: int | None = None,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        """``num_slots`` KV slots of ``max_seq_len`` positions; padded tokens go to ``scratch_slot``."""
        self.forward = forward
        self.max_seq_len = max_seq_len
        self.scratch_slot = scratch_slot
        self.max_running = min(max_running or num_slots, num_slots)
        self.device = torch.device(device)
        self.slots = SlotAllocator(num_slots)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.paused = False
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.counters: dict[str, int] = collections.Counter()
        self.decode_batch_hist: dict[int, int] = collections.Counter()
        self._token_times: collections.deque[tuple[float, int]] = collections.deque()

    # ------------------------------------------------------------------------------ queueing

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; raises ValueError if it cannot fit the KV cache."""
        need = len(seq.prompt) + seq.params.max_new_tokens
        if need > self.max_seq_len:
            raise ValueError(
                f"request {seq.rid}: prompt of {len(seq.prompt)} tokens + max_new_tokens "
                f"{seq.params.max_new_tokens} exceeds the server's max_seq_len {self.max_seq_len}"
            )
        if not seq.prompt:
            raise ValueError(f"request {seq.rid}: input_ids is empty")
        if seq.params.max_new_tokens == 0:
            seq.stop_reason = "length"
            seq.on_finish(seq)
            return
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """True when a step would do something."""
        return bool(self.running) or (bool(self.waiting) and not self.paused)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.stop_reason, seq.error = reason, error
        if seq.slot is not None:
            self.slots.give_back(seq.slot)
            seq.slot = None
        self.counters["requests_finished"] += 1
        seq.on_finish(seq)

    def abort(self, rid: str) -> int:
        """End every sequence of request ``rid`` with stop reason ``"abort"``; returns how many."""
        hit = [s for s in [*self.waiting, *self.running] if s.rid == rid]
        for s in hit:
            if s in self.running:
                self.running.remove(s)
            else:
                self.waiting.remove(s)
            self._finish(s, "abort")
        return len(hit)

    def interrupt_all(self) -> int:
        """End every waiting and running sequence with ``"interrupt"``; returns how many."""
        seqs = [*self.running, *self.waiting]
        self.running, self.waiting = [], collections.deque()
        for s in seqs:
            self._finish(s, "interrupt")
        self.counters["interrupted"] += len(seqs)
        return len(seqs)

    def fail_all(self, error: str) -> int:
        """End every sequence with an error (weights became invalid); returns how many."""
        seqs = [*self.running, *self.waiting]
        self.running, self.waiting = [], collections.deque()
        for s in seqs:
            self._finish(s, "error", error)
        return len(seqs)

    def invalidate_cache(self) -> None:
        """Forget every cached key (after a weight update): running sequences re-feed everything."""
        for s in self.running:
            s.cached_len = 0

    # ------------------------------------------------------------------------------ stepping

    def _admit(self) -> None:
        while (self.waiting and self.slots.num_free and len(self.running) < self.max_running
               and not self.paused):
            seq = self.waiting.popleft()
            seq.slot = self.slots.take()
            seq.cached_len = 0
            self.running.append(seq)

    def _block(self, seqs: list[Sequence]) -> tuple[torch.Tensor, ...]:
        """Padded ``[B, T]`` tokens/positions/write slots, ``[B]`` read slots and logit index."""
        feeds = [s.all_tokens[s.cached_len :] for s in seqs]
        T = max(len(f) for f in feeds)
        B = len(seqs)
        tokens = torch.zeros(B, T, dtype=torch.long)
        positions = torch.zeros(B, T, dtype=torch.long)
        write = torch.full((B, T), self.scratch_slot, dtype=torch.long)
        for b, (s, f) in enumerate(zip(seqs, feeds, strict=True)):
            n = len(f)
            tokens[b, :n] = torch.tensor(f)
            positions[b] = torch.arange(s.cached_len, s.cached_len + T)
            positions[b, n:] = s.cached_len  # pad queries: harmless positions, writes to scratch
            write[b, :n] = s.slot
        read = torch.tensor([s.slot for s in seqs], dtype=torch.long)
        last = torch.tensor([len(f) - 1 for f in feeds], dtype=torch.long)
        return tuple(t.to(self.device) for t in (tokens, positions, write, read, last))

    def step(self, version: int) -> int:
        """Run one step at weight ``version``; returns the number of tokens sampled."""
        self._admit()
        if not self.running:
            return 0
        prefill = [s for s in self.running if len(s.all_tokens) - s.cached_len > 1]
        decode = [s for s in self.running if len(s.all_tokens) - s.cached_len == 1]
        order: list[Sequence] = []
        logits: list[torch.Tensor] = []
        for group, kind in ((prefill, "prefill"), (decode, "decode")):
            if not group:
                continue
            block = self._block(group)
            logits.append(self.forward(*block))
            fed = sum(len(s.all_tokens) - s.cached_len for s in group)
            self.counters[f"{kind}_steps"] += 1
            self.counters[f"{kind}_tokens"] += fed
            self.counters["forward_tokens"] += fed
            if kind == "decode":
                self.decode_batch_hist[len(group)] += 1
            for s in group:
                s.cached_len = len(s.all_tokens)
            order += group
        self.counters["steps"] += 1
        tokens, logprobs = sample(
            torch.cat(logits),
            [s.params for s in order],
            [len(s.output_tokens) for s in order],
            self.generator,
        )
        now = time.monotonic()
        done: list[tuple[Sequence, str]] = []
        for s, tok, lp in zip(order, tokens.tolist(), logprobs.tolist(), strict=True):
            s.output_tokens.append(tok)
            s.output_logprobs.append(lp)
            s.output_versions.append(version)
            if s.first_token_time is None:
                s.first_token_time = now
            else:
                s.itl.append(now - (s.last_token_time or now))
            s.last_token_time = now
            n = len(s.output_tokens)
            if tok in s.params.stop_token_ids and n >= s.params.min_new_tokens:
                done.append((s, "stop"))
            elif n >= s.params.max_new_tokens:
                done.append((s, "length"))
        self.counters["generated_tokens"] += len(order)
        self._token_times.append((now, len(order)))
        for s, reason in done:
            self.running.remove(s)
            self._finish(s, reason)
        return len(order)

    # ------------------------------------------------------------------------------ metrics

    def tokens_per_second(self, window: float = 5.0) -> float:
        """Sampled tokens per second over the last ``window`` seconds."""
        now = time.monotonic()
        while self._token_times and self._token_times[0][0] < now - window:
            self._token_times.popleft()
        if not self._token_times:
            return 0.0
        span = max(now - self._token_times[0][0], 1e-3)
        return sum(n for _, n in self._token_times) / span

    def metrics(self) -> dict:
        """Counters and gauges for ``/metrics`` (docs/http.md)."""
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "paused": self.paused,
            "free_slots": self.slots.num_free,
            "max_running": self.max_running,
            "max_seq_len": self.max_seq_len,
            "tokens_per_s": self.tokens_per_second(),
            "max_decode_batch": max(self.decode_batch_hist, default=0),
            "decode_batch_hist": {str(k): v for k, v in sorted(self.decode_batch_hist.items())},
            **{
                k: int(self.counters[k])
                for k in (
                    "steps",
                    "prefill_steps",
                    "decode_steps",
                    "prefill_tokens",
                    "decode_tokens",
                    "forward_tokens",
                    "generated_tokens",
                    "requests_finished",
                    "interrupted",
                )
            },
        }
