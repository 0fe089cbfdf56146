"""What goes on the wire between two transfer ranks: ops, buckets and the messages cut from them.

A `WireBucket` is the planner's unit (ops of one (sender, receiver) pair, at most bucket_bytes,
16-byte aligned byte offsets). The executor does not send a bucket as one message: `pair_messages`
cuts every bucket into `WireMessage`s by a rule that reads only what both sides of the pair see
identically (each op's wire bytes, box shape and byte offset), so sender and receiver cut the
same messages without exchanging anything:

* an op of at least ``solo_bytes`` travels alone, in row-range chunks of at most
  ``message_bytes``; such a message may be sent from, or received into, the parameter's own
  memory when that side's box is contiguous in the wire dtype (zero-copy);
* smaller ops are grouped, in plan order, into messages of at most ``message_bytes`` that go
  through a staging slot (one message instead of one per small op), repacked at 16-byte aligned
  offsets of their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from awex_fast.plan.planner import RankPlan

_ALIGN = 16  # byte alignment of every op inside a staged message (vectorised copies)


@dataclass(frozen=True)
class WireOp:
    """One box of a bucket, seen from this rank: ``offset``/``shape`` address this rank's local
    tensor ``name``; its bytes sit at ``byte_offset`` of the bucket (or message) in ``wire_dtype``."""

    name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    wire_dtype: torch.dtype
    byte_offset: int

    @property
    def nbytes(self) -> int:
        """Packed bytes on the wire."""
        return math.prod(self.shape) * self.wire_dtype.itemsize


@dataclass(frozen=True)
class WireBucket:
    """One planned bucket between this rank and ``peer``: ``role`` is "send" or "recv"; ``seq``
    orders the buckets of one (sender, receiver) pair."""

    role: str
    peer: int
    seq: int
    wire_bytes: int
    ops: tuple[WireOp, ...]


@dataclass(frozen=True)
class WireMessage:
    """One transport message of a pair: ``tag`` numbers the pair's messages from 0 (it is the
    transport tag and the order both sides post them in); ``bucket`` is the planner bucket it
    came from; ``ops`` carry byte offsets relative to the message; ``solo`` marks a message that
    holds one op (or one chunk of one) and may therefore go zero-copy."""

    role: str
    peer: int
    tag: int
    bucket: int
    nbytes: int
    ops: tuple[WireOp, ...]
    solo: bool


def _chunks(op: WireOp, limit: int) -> list[WireOp]:
    """``op`` cut into sub-boxes of at most ``limit`` wire bytes where rows allow, in wire order
    (each travels as a message of its own, so its byte offset is left to the caller).

    Only the first dimension larger than 1 is split (the dimensions before it are 1), so every
    sub-box is a contiguous byte range of the op's packed layout; a single row larger than the
    limit is cut along the next dimension the same way."""
    if op.nbytes <= limit:
        return [op]
    d = next((i for i, s in enumerate(op.shape) if s > 1), None)
    if d is None:
        return [op]
    row_bytes = math.prod(op.shape[d + 1 :]) * op.wire_dtype.itemsize
    rows = op.shape[d]
    per = max(1, limit // row_bytes) if row_bytes else rows
    out: list[WireOp] = []
    for r0 in range(0, rows, per):
        r1 = min(rows, r0 + per)
        sub = replace(
            op,
            offset=(*op.offset[:d], op.offset[d] + r0, *op.offset[d + 1 :]),
            shape=(*op.shape[:d], r1 - r0, *op.shape[d + 1 :]),
        )
        out.extend(_chunks(sub, limit) if r1 - r0 == 1 and row_bytes > limit else [sub])
    return out


def pair_messages(
    buckets: Sequence[WireBucket], message_bytes: int, solo_bytes: int
) -> list[WireMessage]:
    """The messages of one (this rank, peer) pair, cut from its buckets in ``seq`` order (see the
    module docstring). Both sides of the pair get the same tags, sizes and byte layouts.

    Within a bucket the small ops come first, repacked back to back (16-byte aligned) into as few
    staged messages as ``message_bytes`` allows, whatever solo ops sit between them in the plan;
    then every solo op, chunked."""
    if message_bytes < 1 or solo_bytes < 1:
        raise ValueError(f"message_bytes ({message_bytes}) and solo_bytes ({solo_bytes}) must be positive")
    out: list[WireMessage] = []

    def emit(b: WireBucket, ops: tuple[WireOp, ...], nbytes: int, solo: bool) -> None:
        out.append(WireMessage(b.role, b.peer, len(out), b.seq, nbytes, ops, solo))

    for b in sorted(buckets, key=lambda b: b.seq):
        group: list[WireOp] = []
        end = 0
        for op in (o for o in b.ops if o.nbytes < solo_bytes):
            at = (end + _ALIGN - 1) // _ALIGN * _ALIGN
            if group and at + op.nbytes > message_bytes:
                emit(b, tuple(group), end, False)
                group, at = [], 0
            group.append(replace(op, byte_offset=at))
            end = at + op.nbytes
        if group:
            emit(b, tuple(group), end, False)
        for op in (o for o in b.ops if o.nbytes >= solo_bytes):
            for c in _chunks(op, message_bytes):
                emit(b, (replace(c, byte_offset=0),), c.nbytes, True)
    return out


def messages_by_peer(
    buckets: Iterable[WireBucket], message_bytes: int, solo_bytes: int
) -> dict[int, list[WireMessage]]:
    """`pair_messages` for every peer of ``buckets`` (all of one role), by peer, peers sorted."""
    per_peer: dict[int, list[WireBucket]] = {}
    for b in buckets:
        per_peer.setdefault(b.peer, []).append(b)
    return {p: pair_messages(bs, message_bytes, solo_bytes) for p, bs in sorted(per_peer.items())}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype name of the metadata ("bfloat16", "float8_e4m3fn", ...)."""
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"unknown dtype name {name!r}")


def wire_buckets(rank_plan: RankPlan) -> list[WireBucket]:
    """This rank's buckets as the executor consumes them, in the plan's wire order (sends, then
    receives, each by (peer, seq)); read through the plan's one op-row reader (`Bucket.ops`).
    Sends address the sender's local boxes, receives the receiver's; the wire carries the
    receiver's dtype (None for a dtype torch lacks)."""
    dtypes: dict[str, torch.dtype | None] = {}

    def wire_dtype(name: str) -> torch.dtype | None:
        if name not in dtypes:
            dtypes[name] = torch_dtype(name) if hasattr(torch, name) else None
        return dtypes[name]

    out = []
    for role, buckets in (("send", rank_plan.sends), ("recv", rank_plan.recvs)):
        for b in buckets:
            ops = tuple(
                WireOp(op.name, op.src_offset if role == "send" else op.dst_offset, op.shape,
                       wire_dtype(op.dst_dtype), op.byte_offset)
                for op in b.ops
            )
            out.append(WireBucket(role, b.peer, b.seq, b.nbytes, ops))
    return out
