"""The one reader of a plan's op rows (`Bucket.ops`, planner._read_op) and its two consumers, the
executor's `wire_buckets` and colocated mode's `plan_boxes`, against a decoding of the raw int64
arrays written here, column by column, from the layout the native planner documents
(csrc/plan: ``OP_*`` / ``B_*`` columns)."""

from __future__ import annotations

import pytest
import torch

from awex_fast.layouts import model_spec
from awex_fast.layouts.synthetic import world_metas
from awex_fast.plan import build_plan
from awex_fast.plan import planner as P
from awex_fast.sync.colocate import plan_boxes
from awex_fast.transfer.wire import wire_buckets


def _raw_buckets(rp):
    """[(role, peer, seq, nbytes, [(name, src, dst, shape, src dtype, dst dtype, at, nbytes)])]
    straight from ``rp.buckets`` / ``rp.ops``."""
    D, b0 = rp.max_ndim, P.OP_BOXES
    out = []
    for brow in rp.buckets.tolist():
        begin, count = brow[P.B_OP_BEGIN], brow[P.B_OP_COUNT]
        ops = []
        for row in rp.ops[begin : begin + count].tolist():
            nd = row[P.OP_NDIM]
            assert row[P.OP_KIND] == brow[P.B_KIND] and row[P.OP_PEER] == brow[P.B_PEER]
            assert rp.max_ndim >= nd and all(x == 0 for x in row[b0 + nd : b0 + D])  # padding
            ops.append((
                rp.names[row[P.OP_PARAM]],
                tuple(row[b0 : b0 + nd]),
                tuple(row[b0 + D : b0 + D + nd]),
                tuple(row[b0 + 2 * D : b0 + 2 * D + nd]),
                P.DTYPES[row[P.OP_SRC_DTYPE]],
                P.DTYPES[row[P.OP_DST_DTYPE]],
                row[P.OP_BYTE_OFFSET],
                row[P.OP_NBYTES],
            ))
        role = "send" if brow[P.B_KIND] == P.SEND else "recv"
        out.append((role, brow[P.B_PEER], brow[P.B_SEQ], brow[P.B_NBYTES], ops))
    return out


def _slices(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@pytest.mark.parametrize(
    ("model", "train", "infer", "bucket_bytes"),
    [
        ("tiny-dense", "tp2,pp2,dp2", "tp2,engines2", 4096),
        ("tiny-dense", "fsdp4,dtype=float32", "tp2,engines3,dtype=bfloat16", 1 << 20),
        ("tiny-moe", "ep4,pp2", "tp2,engines2,ep", 512),
        ("tiny-mla", "ep2,pp2,fsdp2", "tp2,engines2", 4096),
    ],
)
def test_one_reader_serves_buckets_wire_and_colocate(model, train, infer, bucket_bytes):
    tm, im = world_metas(model_spec(model), train, infer)
    plan = build_plan(tm, im, bucket_bytes=bucket_bytes, min_part_bytes=256)
    for rank in sorted({*plan.senders, *plan.receivers}):
        rp = plan.for_rank(rank)
        raw = _raw_buckets(rp)
        # Bucket / Op objects
        got = [
            ("send" if b in rp.sends else "recv", b.peer, b.seq, b.nbytes,
             [(o.name, o.src_offset, o.dst_offset, o.shape, o.src_dtype, o.dst_dtype, o.byte_offset, o.nbytes)
              for o in b.ops])
            for b in (*rp.sends, *rp.recvs)
        ]
        assert got == raw
        # the executor's view: this side's boxes, the receiver's dtype on the wire
        wire = [
            (w.role, w.peer, w.seq, w.wire_bytes,
             [(o.name, o.offset, o.shape, o.wire_dtype, o.byte_offset) for o in w.ops])
            for w in wire_buckets(rp)
        ]
        assert wire == [
            (role, peer, seq, nbytes,
             [(n, s if role == "send" else d, sh, getattr(torch, dt), at)
              for n, s, d, sh, _, dt, at, _ in ops])
            for role, peer, seq, nbytes, ops in raw
        ]
        # colocated mode's view: every received box, per training peer, in row order
        want: dict[int, list] = {}
        for role, peer, _, _, ops in raw:
            if role == "recv":
                boxes = ((n, _slices(s, sh), _slices(d, sh)) for n, s, d, sh, *_ in ops)
                want.setdefault(peer, []).extend(boxes)
        boxes = {p: [(b.name, b.src, b.dst) for b in bs] for p, bs in plan_boxes(rp).items()}
        assert boxes == dict(sorted(want.items()))
        assert rank not in plan.receivers or boxes  # a receiving rank reads something
