"""Python face of the native resharding planner (csrc/plan).

Why a native planner: a Kimi-K2-sized MoE has ~70k tensors and ~9M inference pieces; Awex 0.9
plans them as Python objects and spends seconds per rank. `build_plan` hands both sides'
metadata objects to the native core, which reads them once into flat int64 arrays (each distinct
`ShardRule` once, referenced by index and never expanded; csrc/plan/plan_bindings.cpp), then
canonicalises and validates them; `Plan.for_rank` costs one native scan of the metadata plus that
rank's own ops, which come back as one int64 array (`RankPlan.ops`) wrapped lazily into `Bucket`
/ `Op` objects.

The plan (see csrc/plan/solve.h for the details):

- every element of every inference piece is written exactly once, from a training piece that
  holds it; a region no training piece holds is a `PlanError`;
- replica balancing is decided per parameter from its metadata alone (so both sides derive the
  same choice and no rank needs the world's plan): a region held by m > 1 training pieces and
  needed by E inference pieces with the same box (E engines) is cut into
  ``min(m / gcd(E, m), bytes / min_part_bytes)`` near-equal slabs along its outermost dim, and
  the E x slabs pieces are dealt round robin over the m holders, continuing from one receiver of
  the box to the next: every holder sends the same number of slabs (+-1 row). With E >= m
  (more engines than replicas) queries travel whole, as few ops and peers as possible; with one
  engine and DP=4 every replica sends a quarter. Regions below ``min_part_bytes`` (default
  ``MIN_PART_BYTES``) go whole to one holder, rotated per receiver. `Plan.stats` reports the
  resulting ``imbalance`` next to a lower bound no replica choice can beat;
- ops of a (sender, receiver) pair are ordered by (parameter in canonical order, destination
  piece, destination cell, slab) and packed greedily into buckets of at most ``bucket_bytes``
  receiver-dtype bytes, each op starting at a multiple of ``OP_ALIGN`` bytes; an op larger than a
  bucket is cut along its outermost dim (rows), and if one row is still larger, along the next
  dim inside each row, and so on;
- `Plan.digest` hashes the canonical metadata (names sorted, pieces and rules sorted),
  ``bucket_bytes`` and the planner version natively with two independent 64-bit hashes
  (csrc/plan/hash.h), so any rank computes it without planning; equal digests mean equal plans.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from awex_fast._native import native
from awex_fast.meta import (
    MetadataError,
    ParameterMeta,
    ShardMeta,
    ShardRule,
    dtype_itemsize,
    dtype_name,
    merge_metas,
    validate_metas,
)

_plan = native().plan

# Dtype codes used in op arrays and hashed into the digest: append only, never reorder.
DTYPES: tuple[str, ...] = (
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "bool",
    "complex32", "complex64", "complex128",
)  # fmt: skip
_DTYPE_CODE: dict[str, int] = {n: i for i, n in enumerate(DTYPES)}
_ITEMSIZES: list[int] = [dtype_itemsize(n) for n in DTYPES]
# The casts the copy layer does, from its native list (csrc/copy/copy.h, kCastDtypes): any dtype
# to itself (bitwise), and among the cast dtypes. [training dtype code, inference dtype code].
_CAST_DTYPES: tuple[str, ...] = tuple(native().copy.CAST_DTYPES)
_CAN_COPY = np.eye(len(DTYPES), dtype=bool)
_CAN_COPY[np.ix_([_DTYPE_CODE[n] for n in _CAST_DTYPES], [_DTYPE_CODE[n] for n in _CAST_DTYPES])] = True

PLANNER_VERSION: int = _plan.VERSION
OP_ALIGN: int = _plan.OP_ALIGN
MIN_PART_BYTES: int = _plan.MIN_PART_BYTES

# Columns of `RankPlan.ops` ([n_ops, OP_BOXES + 3 * max_ndim] int64). After OP_BOXES come
# src_offset[D] (sender's local coords), dst_offset[D] (receiver's local coords), shape[D];
# D = `Plan.max_ndim`; entries past an op's ndim are 0 (offsets) and 1 (shape).
OP_KIND, OP_PEER, OP_BUCKET, OP_PARAM, OP_SRC_DTYPE, OP_DST_DTYPE = 0, 1, 2, 3, 4, 5
OP_BYTE_OFFSET, OP_NBYTES, OP_NDIM = 6, 7, 8
OP_BOXES: int = _plan.OP_BOXES
# Columns of `RankPlan.buckets` ([n_buckets, BUCKET_COLS] int64); sends first, then receives,
# each sorted by (peer, seq); a bucket's ops are rows [op_begin, op_begin + op_count) of ops.
B_KIND, B_PEER, B_SEQ, B_OP_BEGIN, B_OP_COUNT, B_NBYTES, B_PAYLOAD = 0, 1, 2, 3, 4, 5, 6
BUCKET_COLS: int = _plan.BUCKET_COLS
SEND, RECV = 0, 1


class PlanError(ValueError):
    """Metadata that cannot be planned; the message names the parameter (and rank, box)."""


def _dtype_fallback(dtype: Any, name: str) -> int:
    """Code of a dtype given as anything but its canonical name (``torch.bfloat16``, "half")."""
    code = _DTYPE_CODE.get(dtype_name(dtype))
    if code is None:
        raise PlanError(f"parameter {name!r}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    return code


@dataclass(frozen=True, slots=True)
class Op:
    """One box copy: ``shape`` elements of parameter ``name`` from ``src_offset`` of the sender's
    local tensor to ``dst_offset`` of the receiver's, packed in the bucket at ``byte_offset`` as
    ``nbytes`` bytes of ``dst_dtype``."""

    name: str
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    shape: tuple[int, ...]
    src_dtype: str
    dst_dtype: str
    byte_offset: int
    nbytes: int

    @property
    def src_box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offset, shape) in the sender's local tensor."""
        return self.src_offset, self.shape

    @property
    def dst_box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offset, shape) in the receiver's local tensor."""
        return self.dst_offset, self.shape

    def src_slices(self) -> tuple[slice, ...]:
        """Index of the source box: ``local_tensor[op.src_slices()]``."""
        return tuple(slice(o, o + n) for o, n in zip(self.src_offset, self.shape, strict=True))

    def dst_slices(self) -> tuple[slice, ...]:
        """Index of the destination box: ``local_tensor[op.dst_slices()]``."""
        return tuple(slice(o, o + n) for o, n in zip(self.dst_offset, self.shape, strict=True))


def _read_op(row: Sequence[int], names: Sequence[str], max_ndim: int) -> Op:
    """One row of a rank's op array (see the ``OP_*`` columns) as an `Op`: the one reader of the
    row layout; ``names`` are the plan's parameter names, ``max_ndim`` its `Plan.max_ndim`."""
    nd, D, b = row[OP_NDIM], max_ndim, OP_BOXES
    return Op(
        names[row[OP_PARAM]],
        tuple(row[b : b + nd]),
        tuple(row[b + D : b + D + nd]),
        tuple(row[b + 2 * D : b + 2 * D + nd]),
        DTYPES[row[OP_SRC_DTYPE]],
        DTYPES[row[OP_DST_DTYPE]],
        row[OP_BYTE_OFFSET],
        row[OP_NBYTES],
    )


class OpList(Sequence[Op]):
    """Lazy view of rows ``[begin, end)`` of a rank's op array as `Op` objects."""

    __slots__ = ("_begin", "_dims", "_end", "_names", "_ops")

    def __init__(self, ops: np.ndarray, begin: int, end: int, names: Sequence[str], max_ndim: int) -> None:
        self._ops, self._begin, self._end, self._names, self._dims = ops, begin, end, names, max_ndim

    def __len__(self) -> int:
        return self._end - self._begin

    def _op(self, i: int) -> Op:
        return _read_op(self._ops[self._begin + i].tolist(), self._names, self._dims)

    @overload
    def __getitem__(self, i: int) -> Op: ...
    @overload
    def __getitem__(self, i: slice) -> list[Op]: ...
    def __getitem__(self, i: int | slice) -> Op | list[Op]:
        if isinstance(i, slice):
            return [self._op(k) for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < -n or i >= n:
            raise IndexError(f"op index {i} out of range for a bucket of {n} ops")
        return self._op(i % n)

    def __iter__(self) -> Iterator[Op]:
        names, dims = self._names, self._dims
        return (_read_op(row, names, dims) for row in self._ops[self._begin : self._end].tolist())

    def __repr__(self) -> str:
        return f"OpList({len(self)} ops)"


@dataclass(frozen=True)
class Bucket:
    """One message between this rank and ``peer``: ``nbytes`` on the wire (ops packed at their
    `Op.byte_offset`, receiver dtypes), ``payload`` of them data. ``seq`` numbers the buckets of
    one direction and peer from 0; ``rows`` selects the bucket's rows of `RankPlan.ops`."""

    peer: int
    nbytes: int
    ops: OpList
    seq: int = 0
    payload: int = 0
    rows: slice | None = None


@dataclass(frozen=True)
class RankPlan:
    """What one transfer rank sends and receives: buckets per peer in wire order, over the raw
    ``ops`` / ``buckets`` arrays (column constants ``OP_*`` / ``B_*`` in this module). Read the op
    rows through the buckets' `OpList`s (`Bucket.ops`), never by column index: `_read_op` is the
    one decoder of the row layout."""

    rank: int
    sends: list[Bucket]
    recvs: list[Bucket]
    ops: np.ndarray
    buckets: np.ndarray
    names: tuple[str, ...]
    max_ndim: int
    plan_time_s: float

    @property
    def send_bytes(self) -> int:
        """Payload bytes this rank sends."""
        return sum(b.payload for b in self.sends)

    @property
    def recv_bytes(self) -> int:
        """Payload bytes this rank receives."""
        return sum(b.payload for b in self.recvs)


def _native_call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except _plan.PlanError as exc:
        raise PlanError(str(exc)) from None


class Plan:
    """A validated, canonicalised pair of metadata sets; per-rank plans are computed on demand
    (`for_rank`), world-wide counts by `stats`. Build it with `build_plan`."""

    def __init__(self, world: Any, bucket_bytes: int, build_time_s: float) -> None:
        self._world = world
        self.bucket_bytes = bucket_bytes
        self.build_time_s = build_time_s
        self.names: tuple[str, ...] = tuple(world.names())
        table = world.param_table()  # [P, 5 + MAX_DIMS]: ndim, dtypes, itemsizes, shape
        self._table = table
        self.max_ndim: int = (world.op_cols - OP_BOXES) // 3
        self.train_only: tuple[str, ...] = tuple(self.names[i] for i in np.flatnonzero(table[:, 2] < 0))
        self._planned = int(np.count_nonzero((table[:, 1] >= 0) & (table[:, 2] >= 0)))
        self._stats: dict[str, Any] | None = None
        self._digest: str | None = None

    @property
    def senders(self) -> list[int]:
        """Every training transfer rank that holds a piece."""
        return self._world.side_ranks(0).tolist()

    @property
    def receivers(self) -> list[int]:
        """Every inference transfer rank that holds a piece."""
        return self._world.side_ranks(1).tolist()

    def for_rank(self, transfer_rank: int) -> RankPlan:
        """The buckets ``transfer_rank`` sends (training side) or receives (inference side); a
        rank without pieces gets an empty plan. Costs one scan of the metadata plus the rank's
        own ops; the whole world's op list is never built."""
        rank = int(transfer_rank)
        if rank < 0:
            raise PlanError(f"transfer rank must be non-negative, got {rank}")
        t0 = time.perf_counter()
        ops, buckets = _native_call(self._world.plan_rank, rank)
        ops.flags.writeable = False
        buckets.flags.writeable = False
        sends: list[Bucket] = []
        recvs: list[Bucket] = []
        for kind, peer, seq, begin, count, nbytes, payload in buckets.tolist():
            view = OpList(ops, begin, begin + count, self.names, self.max_ndim)
            bucket = Bucket(peer, nbytes, view, seq, payload, slice(begin, begin + count))
            (sends if kind == SEND else recvs).append(bucket)
        elapsed = time.perf_counter() - t0
        return RankPlan(rank, sends, recvs, ops, buckets, self.names, self.max_ndim, elapsed)

    def digest(self) -> str:
        """32 hex digits over the canonical metadata, ``bucket_bytes`` and the planner version."""
        if self._digest is None:
            self._digest = _native_call(self._world.digest)
        return self._digest

    def stats(self) -> dict[str, Any]:
        """World-wide counts, computed natively over every pair without materialising ops:
        total/wire bytes, ops, buckets, pairs, per-rank send/recv bytes (max, mean, and
        ``per_rank_send`` / ``per_rank_recv``), ``imbalance`` (busiest sender / mean sender),
        ``imbalance_even`` (what splitting every region evenly over its replicas gives),
        ``imbalance_bound`` (a lower bound for any replica choice: for every set S of ranks
        holding some region, the bytes only S's ranks hold, over |S|), names only on the
        training side, and build / stats times."""
        if self._stats is not None:
            return dict(self._stats)
        t0 = time.perf_counter()
        w = _native_call(self._world.world_stats)
        elapsed = time.perf_counter() - t0
        send, recv = w["send_bytes"], w["recv_bytes"]
        s_mean = float(send.mean()) if send.size else 0.0
        r_mean = float(recv.mean()) if recv.size else 0.0

        def ratio(x: float) -> float:
            return x / s_mean if s_mean > 0 else 1.0

        self._stats = {
            "params": self._planned,
            "train_only_names": list(self.train_only),
            "total_bytes": int(w["total_bytes"]),
            "wire_bytes": int(w["wire_bytes"]),
            "ops": int(w["ops"]),
            "buckets": int(w["buckets"]),
            "pairs": int(w["pairs"]),
            "senders": int(send.size),
            "receivers": int(recv.size),
            "send_bytes_max": int(send.max()) if send.size else 0,
            "send_bytes_mean": s_mean,
            "recv_bytes_max": int(recv.max()) if recv.size else 0,
            "recv_bytes_mean": r_mean,
            "imbalance": ratio(float(send.max())) if send.size else 1.0,
            "imbalance_even": ratio(float(w["even_bytes"].max())) if send.size else 1.0,
            "imbalance_bound": ratio(max(s_mean, float(w["bound_bytes"]))) if send.size else 1.0,
            "per_rank_send": dict(zip(w["senders"].tolist(), send.tolist(), strict=True)),
            "per_rank_recv": dict(zip(w["receivers"].tolist(), recv.tolist(), strict=True)),
            "bucket_bytes": self.bucket_bytes,
            "build_time_s": self.build_time_s,
            "stats_time_s": elapsed,
            "digest": self.digest(),
        }
        return dict(self._stats)


def build_plan(
    train_metas: Iterable[Any],
    infer_metas: Iterable[Any],
    bucket_bytes: int = 256 << 20,
    *,
    min_part_bytes: int = MIN_PART_BYTES,
    check_casts: bool = True,
) -> Plan:
    """Validate and canonicalise both sides' metadata (ranks already transfer ranks) and return
    a `Plan`. ``min_part_bytes``: a region several training replicas hold is split among them in
    parts of at least this size (part of the digest, like ``bucket_bytes``). Raises `PlanError`
    naming the parameter for: an inference name the training side lacks, a global shape
    mismatch, a rank on both sides, a region no training piece covers, malformed pieces or rules,
    two pieces of one rank that overlap (in global space or in its local tensor; the message
    then names the side and `validate_metas`'s finding), an unknown dtype, a dtype pair the copy
    layer cannot cast (`awex_fast.transfer.boxcopy.CAST_DTYPES`), or ``bucket_bytes`` below one element.
    ``check_casts=False`` skips only the cast check, for plans that are studied, never executed
    (``awex-fast plan`` projecting an FP8 inference layout; see `unsupported_casts`)."""
    bucket_bytes = int(bucket_bytes)
    t0 = time.perf_counter()
    train = train_metas if isinstance(train_metas, (list, tuple)) else list(train_metas)
    infer = infer_metas if isinstance(infer_metas, (list, tuple)) else list(infer_metas)
    world = _native_call(
        _plan.World, train, infer, bucket_bytes, _DTYPE_CODE, _ITEMSIZES, _dtype_fallback,
        int(min_part_bytes),
    )
    plan = Plan(world, bucket_bytes, 0.0)
    if check_casts:
        _check_casts(plan)
    # The native reader checked each piece alone (bounds, ranks, rule grids); pieces of one rank
    # that overlap (two global boxes written to one local box, or one box held twice) are found
    # here, before any rank builds its ops: natively, in one sweep per side over the canonical
    # pieces. Only when that finds one does `validate_metas` run, to name the parameter, the rank
    # and both boxes as the metadata gives them (and to let pass what its merge drops: exact
    # duplicates reported by two entries of one name, which the native sweep counts twice).
    for side, metas in ((0, train), (1, infer)):
        if world.first_overlap(side) >= 0:
            _check_pieces(metas, ("training", "inference")[side])
    plan.build_time_s = time.perf_counter() - t0
    return plan


def unsupported_casts(plan: Plan) -> str | None:
    """The `PlanError` message `build_plan` gives for ``plan``'s first dtype pair the copy layer
    cannot cast, or None when it can do every pair."""
    try:
        _check_casts(plan)
    except PlanError as exc:
        return str(exc)
    return None


def _check_casts(plan: Plan) -> None:
    """PlanError naming the first parameter whose training -> inference dtype pair the copy
    layer cannot do (it would otherwise fail on the sender mid-update, its receiver waiting out
    its timeout)."""
    table = plan._table
    planned = (table[:, 1] >= 0) & (table[:, 2] >= 0)
    src, dst = table[planned, 1], table[planned, 2]
    bad = np.flatnonzero(~_CAN_COPY[src, dst])
    if bad.size:
        i = int(np.flatnonzero(planned)[bad[0]])
        a, b = DTYPES[table[i, 1]], DTYPES[table[i, 2]]
        raise PlanError(
            f"parameter {plan.names[i]!r}: the training side holds {a} and the inference side {b}, "
            f"and the copy layer cannot cast {a} -> {b} (casts are among {', '.join(_CAST_DTYPES)}; "
            f"other dtypes copy only to themselves); {bad.size} parameter(s) have such a pair"
        )


def _as_meta(m: Any) -> ParameterMeta:
    """A duck-typed metadata object (read by the native planner already) as a `ParameterMeta`."""
    if type(m) is ParameterMeta:
        return m
    shards = tuple(
        ShardMeta(s.rank, s.global_offset, s.shape, getattr(s, "local_offset", None))
        for s in getattr(m, "shards", ())
    )
    rules = tuple(
        ShardRule(r.ranks, r.split_dims, r.num_chunks, r.replicas, getattr(r, "local_offset", None))
        for r in getattr(m, "rules", ())
    )
    return ParameterMeta(str(m.name), m.global_shape, dtype_name(m.dtype), shards, rules)


_NAME = operator.attrgetter("name")


def _check_pieces(metas: Sequence[Any], side: str) -> None:
    """`validate_metas` over one side as the planner reads it (entries of one name merged),
    its `MetadataError` raised as a `PlanError` naming the side."""
    try:
        objs = metas if all(type(m) is ParameterMeta for m in metas) else [_as_meta(m) for m in metas]
        if len(set(map(_NAME, objs))) != len(objs):
            objs = merge_metas([objs])
        validate_metas(objs)
    except MetadataError as exc:
        raise PlanError(f"{side} side: {exc}") from exc


__all__ = [
    "BUCKET_COLS",
    "DTYPES",
    "MIN_PART_BYTES",
    "OP_ALIGN",
    "OP_BOXES",
    "PLANNER_VERSION",
    "Bucket",
    "Op",
    "OpList",
    "Plan",
    "PlanError",
    "RankPlan",
    "build_plan",
    "unsupported_casts",
]
