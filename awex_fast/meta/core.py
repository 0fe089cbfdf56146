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

import contextlib
import gc
import heapq
import itertools
import math
import operator
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class MetadataError(ValueError):
    """Malformed, inconsistent or overlapping shard metadata."""


def _int_tuple(values: Iterable[int], what: str, name: str | None = None) -> tuple[int, ...]:
    # operator.index accepts int, numpy and 0-d integer tensors, and refuses floats and strings
    # (int() would silently truncate 1.5 to 1).
    try:
        out = tuple(map(operator.index, values))
    except TypeError as exc:
        where = "" if name is None else f"parameter {name!r}: "
        raise MetadataError(f"{where}{what} must be a sequence of integers, got {_short(values)}") from exc
    return out


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building many small acyclic objects (metadata for 70k tensors):
    collections triggered by allocation counts otherwise make decoding ~5x slower."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt_box(offset: Sequence[int], shape: Sequence[int]) -> str:
    """``[0:4, 8:16]``: the box as slices (``[]`` for a 0-d scalar)."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offset, shape, strict=True)) + "]"


# Element sizes of every dtype torch 2.11-2.13 names (``torch.<name>.itemsize``), so that the
# metadata layer never imports torch. The test compares this table with torch.
_DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bits16": 2,
    **{f"int{b}": 1 for b in range(1, 8)},
    **{f"uint{b}": 1 for b in range(1, 8)},
}
_DTYPE_ALIASES = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "short": "int16",
    "int": "int32",
    "long": "int64",
    "chalf": "complex32",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "bit": "uint1",
}


def dtype_name(dtype: Any) -> str:
    """Canonical dtype string for a ``torch.dtype`` or a name: ``torch.half`` -> ``"float16"``."""
    if type(dtype) is str and dtype in _DTYPE_ITEMSIZE:
        return dtype
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def dtype_itemsize(name: Any) -> int:
    """Bytes per element of a dtype name (or ``torch.dtype``), as torch reports ``itemsize``;
    raises `MetadataError` for a name torch does not know."""
    canon = dtype_name(name)
    try:
        return _DTYPE_ITEMSIZE[canon]
    except KeyError:
        raise MetadataError(f"unknown dtype {canon!r}") from None


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

    # Not a field: `merge_metas` sets (shards, ndim, int64 records) on its results so that the
    # planner reads the explicit pieces as one buffer (csrc/plan/plan_bindings.cpp).
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


# ---- merging, validation, rank spaces, Awex conversion ---------------------------------------


def _shard_key(s: ShardMeta) -> tuple[Any, ...]:
    return (s.rank, s.global_offset, s.local, s.shape, s.local_offset is not None)


def _rule_key(r: ShardRule) -> tuple[Any, ...]:
    return (r.ranks, r.split_dims, r.num_chunks, r.replicas, r.local_offset is not None, r.local_offset or ())


@_gc_paused()
def merge_metas(
    per_rank_lists: Mapping[int, Iterable[ParameterMeta]] | Iterable[Iterable[ParameterMeta]],
) -> list[ParameterMeta]:
    """One `ParameterMeta` per name holding every list's pieces, names sorted.

    ``per_rank_lists`` is a sequence of per-rank lists (position = reporting rank) or a mapping
    ``{rank: list}``. Explicit shards and rules are kept as given (never expanded or regrouped),
    exact duplicates dropped (several ranks may report one shared rule), shards sorted by
    (rank, global_offset, local offset) and rules by their ranks, so any input order gives the
    same result. A name reported with two global shapes or dtypes raises `MetadataError` naming
    both reporting ranks and both values.
    """
    items = per_rank_lists.items() if isinstance(per_rank_lists, Mapping) else enumerate(per_rank_lists)
    acc: dict[str, tuple[Any, tuple[int, ...], str, list[ShardMeta], dict[ShardRule, None]]] = {}
    for label, metas in items:
        for m in metas:
            if not isinstance(m, ParameterMeta):
                raise MetadataError(f"rank {label} reported {type(m).__name__}, not ParameterMeta")
            entry = acc.get(m.name)
            if entry is None:
                acc[m.name] = (
                    label,
                    m.global_shape,
                    m.dtype,
                    list(m.shards),
                    dict.fromkeys(m.rules),
                )
                continue
            first, shape, dtype, shards, rules = entry
            for what, ours, theirs in (("global_shape", shape, m.global_shape), ("dtype", dtype, m.dtype)):
                if ours != theirs:
                    raise MetadataError(
                        f"parameter {m.name!r}: rank {first} reports {what} {ours!r} but rank {label} "
                        f"reports {theirs!r}"
                    )
            shards.extend(m.shards)
            rules.update(dict.fromkeys(m.rules))
    pack = _shard_packer()
    out = []
    for name, (_, shape, dtype, shards, rules) in sorted(acc.items()):
        packed = pack(shards, len(shape)) if pack is not None and shards else None
        if packed is None:
            merged = tuple(sorted(dict.fromkeys(shards), key=_shard_key))
        else:
            order, records = packed
            merged = tuple(shards) if order is None else tuple(map(shards.__getitem__, order))
        meta = ParameterMeta(name, shape, dtype, merged, tuple(sorted(rules, key=_rule_key)))
        if packed is not None:
            object.__setattr__(meta, "_shard_pack", (merged, len(shape), records))
        out.append(meta)
    return out


def _shard_packer() -> Any:
    """The native ``pack_shards`` (see csrc/plan/plan_bindings.cpp), or None without awex_fast._C:
    it dedupes and sorts a parameter's shards as ``sorted(dict.fromkeys(shards), key=_shard_key)``
    does and packs their planner records once, so that `build_plan` reads one buffer per
    parameter instead of four attributes per piece (the FSDP2 path's ~92k pieces of a 72B model
    cost 16.7 ms there otherwise)."""
    try:
        from awex_fast._native import native

        return native().plan.pack_shards
    except ImportError:
        return None


# A box in one rank's pieces: (offset, shape, description of where it came from).
_Box = tuple[tuple[int, ...], tuple[int, ...], str]


def _find_overlap(boxes: list[_Box]) -> tuple[_Box, _Box] | None:
    """Two overlapping non-empty boxes, or None. Sort-and-sweep along the dim with the most
    distinct start coordinates: O(n log n + n * A * ndim), A the largest number of boxes whose
    extents on that dim share a point (1 for pieces cut along it, so O(n log n) in practice)."""
    if len(boxes[0][0]) == 0:  # 0-d: every non-empty piece is the whole scalar
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    nd = len(boxes[0][0])
    d = max(range(nd), key=lambda k: len({b[0][k] for b in boxes}))
    his = [tuple(map(operator.add, b[0], b[1])) for b in boxes]
    active: list[tuple[int, int]] = []  # heap of (end on dim d, box index)
    for start, i in sorted((b[0][d], i) for i, b in enumerate(boxes)):
        while active and active[0][0] <= start:
            heapq.heappop(active)
        lo, hi = boxes[i][0], his[i]
        for _, j in active:
            if all(map(operator.lt, lo, his[j])) and all(map(operator.lt, boxes[j][0], hi)):
                return boxes[j], boxes[i]
        heapq.heappush(active, (hi[d], i))
    return None


def _rule_piece(rule: ShardRule, k: int, pos: int, gshape: tuple[int, ...]) -> tuple[_Box, _Box]:
    """(global box, local box) of the piece at position ``pos`` of ``rules[k]``."""
    total = rule.total_chunks
    offset, shape = rule.cell_box(gshape, pos % total)
    where = f"rules[{k}] cell {pos % total} replica {pos // total}"
    local = rule.local_offset if rule.local_offset is not None else (0,) * len(gshape)
    return (offset, shape, where), (local, shape, where)


def _overlap(name: str, rank: int, space: str, a: _Box, b: _Box) -> MetadataError:
    return MetadataError(
        f"parameter {name!r}: rank {rank} holds overlapping pieces in {space} space: "
        f"{a[2]} box {_fmt_box(a[0], a[1])} and {b[2]} box {_fmt_box(b[0], b[1])}"
    )


def _check_shard(name: str, g: tuple[int, ...], k: int, s: ShardMeta) -> None:
    inside = all(o >= 0 and o + n <= e for o, n, e in zip(s.global_offset, s.shape, g, strict=True))
    bad = (
        "negative rank" if s.rank < 0
        else f"outside global_shape {g}" if not inside
        else f"negative local_offset {s.local_offset}" if min(s.local, default=0) < 0
        else None
    )  # fmt: skip
    if bad is not None:
        box = _fmt_box(s.global_offset, s.shape)
        raise MetadataError(f"parameter {name!r}: shards[{k}] of rank {s.rank}, box {box}: {bad}")


def _check_rule(name: str, g: tuple[int, ...], k: int, rule: ShardRule) -> tuple[Sequence[int], ...]:
    """Checks one rule alone; returns (positions into ranks of its pieces, the ranks there)."""
    positions, held = rule._held(g)
    positions = range(len(held)) if positions is None else positions
    if held and min(held) < 0:
        i = next(i for i, r in enumerate(held) if r < 0)
        off, shape, where = _rule_piece(rule, k, positions[i], g)[0]
        box = _fmt_box(off, shape)
        raise MetadataError(f"parameter {name!r}: {where} has negative rank {held[i]} (box {box})")
    if min(rule.local_offset or (), default=0) < 0:
        raise MetadataError(f"parameter {name!r}: rules[{k}] has negative local_offset {rule.local_offset}")
    if len(set(held)) != len(held):  # a rank with two pieces of one rule: same cell or same local box
        first: dict[int, int] = {}
        for i, r in enumerate(held):
            if r in first:
                p, q = positions[first[r]], positions[i]
                same_cell = p % rule.total_chunks == q % rule.total_chunks
                gp, lp = _rule_piece(rule, k, p, g)
                gq, lq = _rule_piece(rule, k, q, g)
                raise _overlap(name, r, "global", gp, gq) if same_cell else _overlap(name, r, "local", lp, lq)
            first[r] = i
    return positions, held


# (id(rule), global_shape) -> (rule, positions, held); holding the rule keeps its id unique.
_RuleCache = dict[tuple[int, tuple[int, ...]], tuple[ShardRule, Sequence[int], Sequence[int]]]


def _shards_in_bounds(shards: Sequence[ShardMeta], g: tuple[int, ...]) -> bool:
    """Whether every explicit piece has a non-negative rank and local offset and lies inside
    ``g``: one pass of C-level iterators over all pieces (validating 100k explicit pieces is then
    a few ms, not a Python loop per piece); `_check_shard` names the culprit when this fails."""
    if min(map(_RANK, shards)) < 0:
        return False
    offsets = list(itertools.chain.from_iterable(map(_GLOBAL_OFFSET, shards)))
    if min(offsets, default=0) < 0:
        return False
    ends = map(operator.add, offsets, itertools.chain.from_iterable(map(_SHAPE, shards)))
    if not all(map(operator.le, ends, itertools.cycle(g))):
        return False
    locals_ = itertools.chain.from_iterable(filter(None, map(_LOCAL_OFFSET, shards)))
    return min(locals_, default=0) >= 0


_RANK = operator.attrgetter("rank")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")
_SHAPE = operator.attrgetter("shape")
_LOCAL_OFFSET = operator.attrgetter("local_offset")


def _validate_param(m: ParameterMeta, cache: _RuleCache) -> None:
    name, g = m.name, m.global_shape
    if m.dtype not in _DTYPE_ITEMSIZE:
        raise MetadataError(f"parameter {name!r}: unknown dtype {m.dtype!r}")
    shards = m.shards
    if shards and not _shards_in_bounds(shards, g):
        for k, s in enumerate(shards):
            _check_shard(name, g, k, s)
    holders = []
    for k, rule in enumerate(m.rules):
        hit = cache.get((id(rule), g))
        if hit is None or hit[0] is not rule:
            hit = cache[(id(rule), g)] = (rule, *_check_rule(name, g, k, rule))
        holders.append(hit[1:])
    if not shards and len(holders) < 2:  # the common generated layout: one rule, checked above
        return
    # Only a rank holding more than one piece can overlap itself: count pieces per rank (C-level
    # work) and materialise just those ranks' pieces. A rule's own cells are disjoint and a rank
    # listed twice in one rule was caught by `_check_rule`.
    counts = Counter(map(_RANK, shards))
    if not holders and len(counts) == len(shards):
        return
    for _, held in holders:
        counts.update(held)
    shared = {r for r, c in counts.items() if c > 1}
    if not shared:
        return
    # rank -> [(global box, local box)] of its non-empty pieces
    by_rank: defaultdict[int, list[tuple[_Box, _Box]]] = defaultdict(list)
    for k, s in enumerate(shards):
        if s.rank in shared and 0 not in s.shape:
            tag = f"shards[{k}]"
            by_rank[s.rank].append(((s.global_offset, s.shape, tag), (s.local, s.shape, tag)))
    for k, (positions, held) in enumerate(holders):
        if not shared.isdisjoint(held):
            for i, r in enumerate(held):
                if r in shared:
                    by_rank[r].append(_rule_piece(m.rules[k], k, positions[i], g))
    for r, pieces in by_rank.items():
        if len(pieces) > 1:
            for space, idx in (("global", 0), ("local", 1)):
                hit = _find_overlap([p[idx] for p in pieces])
                if hit is not None:
                    raise _overlap(name, r, space, *hit)


def validate_metas(metas: Iterable[ParameterMeta]) -> None:
    """Check a metadata list; raise `MetadataError` naming the parameter, the rank and the box.

    Checks: names unique; dtype known; ranks non-negative; every piece inside the global shape
    (ndim and rule dims are checked when the objects are built); local offsets non-negative; no
    two non-empty pieces of one rank overlapping in global space or in the rank's local tensor.
    A rule's own cells are disjoint, so a rule costs O(len(ranks)) C-level work (a set of its
    ranks) unless a rank appears twice in it or also in another source of the same parameter;
    only those ranks' pieces are materialised and swept (see `_find_overlap`).
    """
    seen: set[str] = set()
    cache: _RuleCache = {}
    known = _DTYPE_ITEMSIZE
    for i, m in enumerate(metas):
        if type(m) is not ParameterMeta and not isinstance(m, ParameterMeta):
            raise MetadataError(f"metas[{i}] is {type(m).__name__}, not ParameterMeta")
        name, rules = m.name, m.rules
        if name in seen:
            raise MetadataError(f"parameter {name!r} appears more than once (again at metas[{i}])")
        seen.add(name)
        # Fast path (70k-tensor generated layouts): one rule, already checked for this shape.
        if len(rules) == 1 and not m.shards and m.dtype in known:
            hit = cache.get((id(rules[0]), m.global_shape))
            if hit is not None and hit[0] is rules[0]:
                continue
        _validate_param(m, cache)


def _positive_int(value: Any, what: str) -> int:
    try:
        out = 0 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        out = 0
    if out < 1:
        raise MetadataError(f"{what} must be a positive integer, got {_short(value)}")
    return out


def transfer_ranks(engine_sizes: Sequence[int], train_world_size: int) -> tuple[list[int], int]:
    """Transfer-rank bases: inference engine ``e`` starts at ``infer_bases[e]`` (prefix sums of
    ``engine_sizes``; engines may differ in size), training ranks start at ``train_base`` (after
    every inference rank). ``infer_bases[e] + r`` is engine ``e``'s local rank ``r``."""
    bases: list[int] = []
    total = 0
    for e, size in enumerate(engine_sizes):
        bases.append(total)
        total += _positive_int(size, f"engine {e} size")
    _positive_int(train_world_size, "train_world_size")
    return bases, total


@_gc_paused()
def with_rank_offset(metas: Iterable[ParameterMeta], offset: int) -> list[ParameterMeta]:
    """Copies of ``metas`` with every rank (explicit shards and rules) shifted by ``offset``:
    side-local ranks -> transfer ranks. A shift to a negative rank raises `MetadataError`."""
    try:
        offset = operator.index(offset)
    except TypeError:
        raise MetadataError(f"rank offset must be an integer, got {_short(offset)}") from None
    if offset == 0:
        return list(metas)
    moved: dict[ShardRule, ShardRule] = {}
    out = []
    for m in metas:
        shards = tuple(ShardMeta(s.rank + offset, s.global_offset, s.shape, s.local_offset) for s in m.shards)
        rules = []
        for r in m.rules:
            new = moved.get(r)
            if new is None:
                ranks = tuple(map(offset.__add__, r.ranks))
                if ranks and min(ranks) < 0:
                    raise MetadataError(f"parameter {m.name!r}: offset {offset} gives rank {min(ranks)}")
                new = ShardRule._of_ints(ranks, r.split_dims, r.num_chunks, r.replicas, r.local_offset)
                moved[r] = new
            rules.append(new)
        low = min((s.rank for s in shards), default=0)
        if low < 0:
            raise MetadataError(f"parameter {m.name!r}: offset {offset} gives negative rank {low}")
        out.append(ParameterMeta(m.name, m.global_shape, m.dtype, shards, tuple(rules)))
    return out


def metas_from_awex(objs: Iterable[Any], rank_offset: int = 0) -> list[ParameterMeta]:
    """Convert Awex ``ParameterMeta`` objects (duck-typed: ``name``, ``global_shape``, ``dtype`` as a
    ``torch.dtype``, ``shards`` with ``global_rank``, ``global_offset``, ``shape``; other attributes
    such as ``engine_rank``, ``world_size`` and ``replicas`` are ignored) into ours, one per object
    in input order; a piece's rank is ``global_rank + rank_offset``. An empty ``global_offset``
    (Awex's default before offsets are resolved) means zeros. Pass per-rank objects through
    `merge_metas` afterwards."""
    out = []
    for i, obj in enumerate(objs):
        label = f"awex meta {i} ({getattr(obj, 'name', '?')!r})"
        try:
            name, gshape, dtype, src = obj.name, tuple(obj.global_shape), obj.dtype, list(obj.shards)
            shards = []
            for k, sh in enumerate(src):
                try:
                    offset, shape = tuple(sh.global_offset), tuple(sh.shape)
                    rank = operator.index(sh.global_rank) + rank_offset
                    shards.append(ShardMeta(rank, offset or (0,) * len(shape), shape))
                except AttributeError as exc:
                    raise MetadataError(f"{label}: shards[{k}] lacks {exc.name!r}") from None
                except MetadataError as exc:
                    raise MetadataError(f"{label}: shards[{k}]: {exc}") from None
        except AttributeError as exc:
            raise MetadataError(f"{label} lacks the attribute {exc.name!r}") from None
        except TypeError as exc:
            raise MetadataError(f"{label}: {exc}") from None
        out.append(ParameterMeta(str(name), gshape, dtype_name(dtype), tuple(shards)))
    return out
