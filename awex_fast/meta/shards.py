"""Shard metadata: which box of which parameter each rank holds.

Every other part of awex_fast (layout builders, the planner, the executor, the adapters) speaks
this vocabulary. A parameter is described by its canonical (Hugging Face) name, its global shape,
its dtype as a string, and its *pieces*: n-dimensional boxes of the global tensor, each held by
one rank at some offset of that rank's local tensor. Pieces are given explicitly (`ShardMeta`) or
as a compact grid rule (`ShardRule`) that expands to many pieces; the rule form keeps metadata for
1,000+ rank MoE layouts small enough to ship as JSON.

JSON wire format, version 1 (`metas_to_json` / `metas_from_json`; never pickle)::

    {"format": "awex_fast.metas", "version": 1,
     "rules": [[ranks, split_dims, num_chunks, replicas(, local_offset)], ...],  # distinct rules
     "params": [{"name": str, "shape": [int, ...], "dtype": str,
                 "shards": [[rank, offset, shape(, local_offset)], ...],   # optional
                 "rules": [index into the top-level "rules", ...]}]}        # optional

A rule's ``ranks`` is a list of ranks (ints) and ``[start, stop, step]`` triples standing for
``range(start, stop, step)``, concatenated. A Kimi-K2-sized inference layout (70k tensors x 128
pieces) is a few table rules, each one triple, and 7.4 MB of JSON in all.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from awex_fast.meta.dtypes import dtype_itemsize, dtype_name
from awex_fast.meta.errors import MetadataError, _int_tuple, _short


@dataclass(frozen=True)
class ShardMeta:
    """One piece: the box ``[global_offset, global_offset + shape)`` of the global tensor, held by
    ``rank`` at ``local_offset`` (default: zeros) inside that rank's local tensor for the name."""

    rank: int
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_offset: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "rank", operator.index(self.rank))
        except TypeError:
            raise MetadataError(f"rank must be an integer, got {_short(self.rank)}") from None
        object.__setattr__(self, "global_offset", _int_tuple(self.global_offset, "global_offset"))
        object.__setattr__(self, "shape", _int_tuple(self.shape, "shape"))
        nd, what = len(self.shape), f"piece of rank {self.rank}"
        if len(self.global_offset) != nd:
            raise MetadataError(f"{what}: global_offset {self.global_offset} mismatches shape {self.shape}")
        if nd and min(self.shape) < 0:
            raise MetadataError(f"{what}: negative extent in shape {self.shape}")
        if self.local_offset is not None:
            object.__setattr__(self, "local_offset", _int_tuple(self.local_offset, "local_offset"))
            if len(self.local_offset) != nd:
                raise MetadataError(f"{what}: local_offset {self.local_offset} mismatches shape {self.shape}")

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


def _nonempty_chunks(size: int, num_chunks: int) -> int:
    """How many leading chunks of `chunk_bounds` are non-empty (the rest are)."""
    if size <= 0:
        return 0
    step = -(-size // num_chunks)
    return -(-size // step)


_RULE_FIELDS = ("ranks", "split_dims", "num_chunks", "replicas", "local_offset")


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
        put = object.__setattr__
        put(self, "ranks", _int_tuple(self.ranks, "ranks"))
        put(self, "split_dims", _int_tuple(self.split_dims, "split_dims"))
        put(self, "num_chunks", _int_tuple(self.num_chunks, "num_chunks"))
        try:
            put(self, "replicas", operator.index(self.replicas))
        except TypeError:
            raise MetadataError(f"replicas must be an integer, got {_short(self.replicas)}") from None
        if self.local_offset is not None:
            put(self, "local_offset", _int_tuple(self.local_offset, "local_offset"))
        self._check()

    @classmethod
    def _of_ints(cls, *values: Any) -> ShardRule:
        """Build from the five fields as tuples of exact ints (decoded JSON, shifted ranks): the
        constructor's checks without re-converting 128-rank tuples."""
        self = object.__new__(cls)
        for key, value in zip(_RULE_FIELDS, values, strict=True):
            object.__setattr__(self, key, value)
        self._check()
        return self

    def _check(self) -> None:
        dims, chunks = self.split_dims, self.num_chunks
        if len(dims) != len(chunks):
            raise MetadataError(f"rule split_dims {dims} and num_chunks {chunks} differ in length")
        if len(set(dims)) != len(dims) or min(dims, default=0) < 0:
            raise MetadataError(f"rule split_dims {dims} must be distinct non-negative dims")
        if min(chunks, default=1) < 1 or self.replicas < 1:
            raise MetadataError(f"rule num_chunks {chunks} and replicas {self.replicas} must be >= 1")
        if len(self.ranks) != self.total_chunks * self.replicas:
            raise MetadataError(
                f"rule lists {len(self.ranks)} ranks but {self.total_chunks} chunks x "
                f"{self.replicas} replicas need {self.total_chunks * self.replicas}"
            )

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

    def cell_box(self, global_shape: Sequence[int], cell: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(global_offset, shape)`` of grid cell ``cell`` (row-major over ``split_dims``); the
        shape contains a 0 when the cell is empty."""
        offset = [0] * len(global_shape)
        shape = list(global_shape)
        for dim, n in zip(reversed(self.split_dims), reversed(self.num_chunks), strict=True):
            cell, idx = divmod(cell, n)
            start, stop = chunk_bounds(global_shape[dim], n, idx)
            offset[dim], shape[dim] = start, stop - start
        return tuple(offset), tuple(shape)

    def _cells(self, global_shape: Sequence[int]) -> list[int] | None:
        """Indices of the non-empty cells, in order; None when every cell is non-empty."""
        split = set(self.split_dims)
        if any(global_shape[d] == 0 for d in range(len(global_shape)) if d not in split):
            return []
        pairs = zip(self.split_dims, self.num_chunks, strict=True)
        counts = [_nonempty_chunks(global_shape[d], n) for d, n in pairs]
        if counts == list(self.num_chunks):
            return None
        strides = [math.prod(self.num_chunks[i + 1 :]) for i in range(len(counts))]
        return [
            sum(i * s for i, s in zip(idx, strides, strict=True))
            for idx in itertools.product(*(range(k) for k in counts))
        ]

    def nonempty_cells(self, global_shape: Sequence[int]) -> list[int]:
        """Indices of the cells that yield a piece for ``global_shape``, ascending."""
        cells = self._cells(global_shape)
        return list(range(self.total_chunks)) if cells is None else cells

    def num_pieces(self, global_shape: Sequence[int]) -> int:
        """Number of pieces `expand` yields, without expanding."""
        cells = self._cells(global_shape)
        return (self.total_chunks if cells is None else len(cells)) * self.replicas

    def _held(self, global_shape: Sequence[int]) -> tuple[list[int] | None, Sequence[int]]:
        """(positions into ``ranks`` of the pieces, or None for all; the ranks at them)."""
        cells = self._cells(global_shape)
        if cells is None:
            return None, self.ranks
        total = self.total_chunks
        positions = [j * total + c for j in range(self.replicas) for c in cells]
        return positions, [self.ranks[p] for p in positions]


@dataclass(frozen=True)
class ParameterMeta:
    """All pieces of one parameter. ``dtype`` is a torch dtype name without the ``torch.`` prefix
    ("bfloat16", "float32", "float8_e4m3fn", ...). ``shards`` lists explicit pieces, ``rules``
    compact grids; `pieces()` gives both expanded."""

    # Not a field: `merge_metas` sets (shards, ndim, int64 records, name, global_shape, dtype,
    # rules) on its results so that the planner reads the explicit pieces as one buffer and the
    # other fields in one attribute read (csrc/plan/plan_bindings.cpp).
    _shard_pack = None

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    shards: tuple[ShardMeta, ...] = ()
    rules: tuple[ShardRule, ...] = field(default=())

    def __post_init__(self) -> None:
        name, put = self.name, object.__setattr__
        if not isinstance(name, str) or not name:
            raise MetadataError(f"parameter name must be a non-empty string, got {_short(name)}")
        gs = _int_tuple(self.global_shape, "global_shape", name)
        put(self, "global_shape", gs)
        put(self, "dtype", dtype_name(self.dtype))
        shards = self.shards if type(self.shards) is tuple else tuple(self.shards)
        rules = self.rules if type(self.rules) is tuple else tuple(self.rules)
        put(self, "shards", shards)
        put(self, "rules", rules)
        nd = len(gs)
        if nd and min(gs) < 0:
            raise MetadataError(f"parameter {name!r}: negative extent in global_shape {gs}")
        for k, s in enumerate(shards):
            if not isinstance(s, ShardMeta):
                raise MetadataError(f"parameter {name!r}: shards[{k}] is {type(s).__name__}, not ShardMeta")
            if len(s.shape) != nd:
                raise MetadataError(
                    f"parameter {name!r}: shards[{k}] (rank {s.rank}) has {len(s.shape)} dims, "
                    f"global_shape {gs} has {nd}"
                )
        for k, r in enumerate(rules):
            if not isinstance(r, ShardRule):
                raise MetadataError(f"parameter {name!r}: rules[{k}] is {type(r).__name__}, not ShardRule")
            if r.split_dims and max(r.split_dims) >= nd:
                raise MetadataError(f"parameter {name!r}: rules[{k}] splits dims {r.split_dims} of {gs}")
            if r.local_offset is not None and len(r.local_offset) != nd:
                raise MetadataError(
                    f"parameter {name!r}: rules[{k}] local_offset {r.local_offset} has "
                    f"{len(r.local_offset)} dims, global_shape {gs} has {nd}"
                )

    @property
    def numel(self) -> int:
        """Elements in the global tensor."""
        return math.prod(self.global_shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element (`MetadataError` for an unknown dtype)."""
        try:
            return dtype_itemsize(self.dtype)
        except MetadataError:
            raise MetadataError(f"parameter {self.name!r}: unknown dtype {self.dtype!r}") from None

    @property
    def nbytes(self) -> int:
        """Bytes of the global tensor."""
        return self.numel * self.itemsize

    def pieces(self) -> list[ShardMeta]:
        """Explicit pieces followed by every rule's expansion."""
        out = list(self.shards)
        for rule in self.rules:
            out.extend(rule.expand(self.global_shape))
        return out

    def num_pieces(self) -> int:
        """``len(self.pieces())`` without expanding the rules."""
        return len(self.shards) + sum(r.num_pieces(self.global_shape) for r in self.rules)

    def pieces_for_rank(self, rank: int) -> list[ShardMeta]:
        """The pieces ``rank`` holds, in `pieces()` order, found without expanding other ranks'."""
        out = [s for s in self.shards if s.rank == rank]
        for rule in self.rules:
            total, pos, found = rule.total_chunks, -1, []
            while True:
                try:
                    pos = rule.ranks.index(rank, pos + 1)
                except ValueError:
                    break
                found.append((pos % total, pos // total))
            for cell, _replica in sorted(found):
                offset, shape = rule.cell_box(self.global_shape, cell)
                if 0 not in shape:
                    out.append(ShardMeta(rank, offset, shape, rule.local_offset))
        return out

    def ranks(self) -> set[int]:
        """Every rank that holds some piece of this parameter (empty rule cells hold none)."""
        out = {s.rank for s in self.shards}
        for rule in self.rules:
            out.update(rule._held(self.global_shape)[1])
        return out
