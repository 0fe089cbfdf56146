"""Shard metadata: which box of which parameter each rank holds.

Every other part of awex_fast (layout builders, the planner, the executor, the adapters) speaks
this vocabulary. A parameter is described by its canonical (Hugging Face) name, its global shape,
its dtype as a string, and its *pieces*: n-dimensional boxes of the global tensor, each held by
one rank at some offset of that rank's local tensor. Pieces are given explicitly (`ShardMeta`) or
as a compact grid rule (`ShardRule`) that expands to many pieces; the rule form keeps metadata for
1,000+ rank MoE layouts small enough to ship as JSON.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field


class MetadataError(ValueError):
    """Malformed, inconsistent or overlapping shard metadata."""


def _int_tuple(values: Iterable[int], what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError) as exc:
        raise MetadataError(f"{what} must be a sequence of integers, got {values!r}") from exc
    return out


@dataclass(frozen=True)
class ShardMeta:
    """One piece: the box ``[global_offset, global_offset + shape)`` of the global tensor, held by
    ``rank`` at ``local_offset`` (default: zeros) inside that rank's local tensor for the name."""

    rank: int
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_offset: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "global_offset", _int_tuple(self.global_offset, "global_offset"))
        object.__setattr__(self, "shape", _int_tuple(self.shape, "shape"))
        if self.local_offset is not None:
            object.__setattr__(self, "local_offset", _int_tuple(self.local_offset, "local_offset"))

    @property
    def local(self) -> tuple[int, ...]:
        """The local offset with the zero default filled in."""
        return self.local_offset if self.local_offset is not None else (0,) * len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        return math.prod(self.shape)


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``size`` is split into ``num_chunks`` the way
    ``torch.chunk`` and DTensor ``Shard`` do: ceil-sized chunks, trailing ones short or empty."""
    step = -(-size // num_chunks) if num_chunks > 0 else 0
    start = min(size, index * step)
    return start, min(size, start + step)


@dataclass(frozen=True)
class ShardRule:
    """A regular grid of pieces in compact form.

    ``split_dims[i]`` is split into ``num_chunks[i]`` chunks (torch.chunk arithmetic, see
    `chunk_bounds`); chunks are numbered row-major over ``split_dims``; chunk ``c`` of replica
    ``j`` is held by ``ranks[j * total_chunks + c]``, so ``len(ranks) == total_chunks * replicas``.
    Each rank holds its chunk at ``local_offset`` (default zeros). Empty chunks yield no piece.
    """

    ranks: tuple[int, ...]
    split_dims: tuple[int, ...] = ()
    num_chunks: tuple[int, ...] = ()
    replicas: int = 1
    local_offset: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", _int_tuple(self.ranks, "ranks"))
        object.__setattr__(self, "split_dims", _int_tuple(self.split_dims, "split_dims"))
        object.__setattr__(self, "num_chunks", _int_tuple(self.num_chunks, "num_chunks"))
        object.__setattr__(self, "replicas", int(self.replicas))
        if self.local_offset is not None:
            object.__setattr__(self, "local_offset", _int_tuple(self.local_offset, "local_offset"))

    @property
    def total_chunks(self) -> int:
        """Number of grid cells (before dropping empty ones)."""
        return math.prod(self.num_chunks)

    def expand(self, global_shape: Sequence[int]) -> Iterator[ShardMeta]:
        """Yield the explicit pieces of this rule for a tensor of ``global_shape``."""
        ndim = len(global_shape)
        total = self.total_chunks
        cells = itertools.product(*(range(n) for n in self.num_chunks))
        for c, cell in enumerate(cells):
            offset = [0] * ndim
            shape = list(global_shape)
            for dim, n, idx in zip(self.split_dims, self.num_chunks, cell, strict=True):
                start, stop = chunk_bounds(global_shape[dim], n, idx)
                offset[dim], shape[dim] = start, stop - start
            if 0 in shape and ndim > 0:
                continue
            for j in range(self.replicas):
                yield ShardMeta(self.ranks[j * total + c], tuple(offset), tuple(shape), self.local_offset)


@dataclass(frozen=True)
class ParameterMeta:
    """All pieces of one parameter. ``dtype`` is a torch dtype name without the ``torch.`` prefix
    ("bfloat16", "float32", "float8_e4m3fn", ...). ``shards`` lists explicit pieces, ``rules``
    compact grids; `pieces()` gives both expanded."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    shards: tuple[ShardMeta, ...] = ()
    rules: tuple[ShardRule, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", _int_tuple(self.global_shape, "global_shape"))
        object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "rules", tuple(self.rules))

    def pieces(self) -> list[ShardMeta]:
        """Explicit pieces followed by every rule's expansion."""
        out = list(self.shards)
        for rule in self.rules:
            out.extend(rule.expand(self.global_shape))
        return out

    def ranks(self) -> set[int]:
        """Every rank that holds some piece of this parameter."""
        out = {s.rank for s in self.shards}
        for rule in self.rules:
            out.update(rule.ranks)
        return out
