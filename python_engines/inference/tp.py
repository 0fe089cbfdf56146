"""Tensor-parallel arithmetic of the inference decoder: who holds which heads, rows and columns.

Why a separate file: `model.py` should read like a plain decoder. Everything that depends on the
TP rank lives here: the per-rank sizes the forward pass uses (vLLM's ``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``), which KV
heads a rank holds when TP exceeds their count (replicated: rank ``r`` reads KV head
``r // (tp // num_kv_heads)``), the padded vocabulary, and the two collectives the forward pass
needs (all-reduce after row-parallel matmuls, all-gather of vocab-parallel logits). The
authoritative table of the fused tensors is `awex_fast.layouts.fused.FusedLayout`;
`python_engines.inference.weights` checks every parameter's shape against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from awex_fast.layouts import pad_vocab_size

__all__ = ["TPContext", "TPShapes"]


@dataclass(frozen=True)
class TPContext:
    """This process's place in its engine's TP group; ``group`` None means the default group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPContext: rank {self.rank} is not in [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group in place (no-op at TP=1); returns ``x``."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim, in rank order (identity at TP=1)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class TPShapes:
    """Per-rank sizes of every TP-split tensor of a decoder, for one rank of one TP size.

    Heads: ``num_heads_local`` query heads ``[rank * num_heads_local, ...)``; KV heads
    ``[kv_head_start, kv_head_start + num_kv_heads_local)`` where, when ``tp > num_kv_heads``,
    ``num_kv_heads_local`` is 1 and ``kv_head_start = rank // (tp // num_kv_heads)``.
    Vocabulary: rank r holds padded rows ``[r * vocab_local, (r + 1) * vocab_local)``.
    """

    tp: TPContext
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        tp = self.tp.size
        if self.num_heads % tp:
            raise ValueError(f"num_attention_heads={self.num_heads} is not divisible by tp_size={tp}")
        if tp > self.num_kv_heads and tp % self.num_kv_heads:
            raise ValueError(
                f"tp_size={tp} exceeds num_key_value_heads={self.num_kv_heads} but is not a multiple "
                "of it, so KV heads cannot be replicated evenly"
            )
        if tp <= self.num_kv_heads and self.num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads={self.num_kv_heads} is not divisible by tp_size={tp}")
        if self.intermediate_size % tp:
            raise ValueError(f"intermediate_size={self.intermediate_size} is not divisible by tp_size={tp}")
        if self.vocab_padded % tp:
            raise ValueError(f"padded vocabulary {self.vocab_padded} (vocab_size={self.vocab_size} rounded "
                             f"up to a multiple of 64) is not divisible by tp_size={tp}")

    @property
    def num_heads_local(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.tp.size

    @property
    def num_kv_heads_local(self) -> int:
        """KV heads on this rank (1 when they are replicated)."""
        return max(1, self.num_kv_heads // self.tp.size)

    @property
    def kv_head_start(self) -> int:
        """Index of this rank's first KV head."""
        tp, rank = self.tp.size, self.tp.rank
        if tp > self.num_kv_heads:
            return rank // (tp // self.num_kv_heads)
        return rank * self.num_kv_heads_local

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 unless TP exceeds the KV head count)."""
        return max(1, self.tp.size // self.num_kv_heads)

    @property
    def q_size(self) -> int:
        """Rows of this rank's q part of ``qkv_proj`` (and columns of its ``o_proj``)."""
        return self.num_heads_local * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of this rank's k part (and of its v part) of ``qkv_proj``."""
        return self.num_kv_heads_local * self.head_dim

    @property
    def intermediate_local(self) -> int:
        """Rows of each half of ``gate_up_proj`` (and columns of ``down_proj``) on this rank."""
        return self.intermediate_size // self.tp.size

    @property
    def vocab_padded(self) -> int:
        """The padded global vocabulary size (vLLM: a multiple of 64, `pad_vocab_size`)."""
        return pad_vocab_size(self.vocab_size)

    @property
    def vocab_local(self) -> int:
        """Rows of the vocab-parallel embedding and lm_head on this rank."""
        return self.vocab_padded // self.tp.size

    @property
    def vocab_start(self) -> int:
        """First (padded) vocabulary row this rank holds."""
        return self.tp.rank * self.vocab_local
