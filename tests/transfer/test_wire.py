"""How buckets are cut into messages (awex_fast.transfer.wire): both sides of a pair must cut identically,
every byte of every op must travel exactly once, and chunks must be contiguous row ranges."""

from __future__ import annotations

import math

import pytest
import torch

from awex_fast.transfer.wire import WireBucket, WireOp, pair_messages


def _bucket(role: str, ops: list[tuple[str, tuple[int, ...], tuple[int, ...]]], seq: int = 0) -> WireBucket:
    wire_ops, at = [], 0
    for name, offset, shape in ops:
        at = (at + 15) // 16 * 16
        wire_ops.append(WireOp(name, offset, shape, torch.bfloat16, at))
        at += math.prod(shape) * 2
    return WireBucket(role, 1, seq, at, tuple(wire_ops))


OPS = [
    ("big", (0, 0), (64, 100)),  # 12,800 bytes: travels alone, chunked
    ("small.a", (3,), (5,)),
    ("row", (0, 0, 0), (1, 3, 2000)),  # one row of 4,000 bytes after the size-1 dim: cut again
    ("small.b", (0, 2), (4, 4)),
]


def _covered(messages) -> dict[str, set[tuple[int, ...]]]:
    """name -> every element index (local coordinates) that some message carries."""
    out: dict[str, set] = {}
    for m in messages:
        for op in m.ops:
            axes = [torch.arange(o, o + s) for o, s in zip(op.offset, op.shape, strict=True)]
            grid = torch.cartesian_prod(*axes) if len(axes) > 1 else axes[0]
            cells = {tuple(c) for c in grid.reshape(-1, len(op.shape)).tolist()}
            assert not (out.setdefault(op.name, set()) & cells), f"{op.name} sent twice"
            out[op.name] |= cells
    return out


def test_sender_and_receiver_cut_the_same_messages():
    send = pair_messages([_bucket("send", OPS)], message_bytes=1024, solo_bytes=256)
    recv = pair_messages([_bucket("recv", OPS)], message_bytes=1024, solo_bytes=256)
    assert [(m.tag, m.nbytes, m.solo) for m in send] == [(m.tag, m.nbytes, m.solo) for m in recv]
    assert [[(o.shape, o.byte_offset) for o in m.ops] for m in send] == [
        [(o.shape, o.byte_offset) for o in m.ops] for m in recv
    ]


def test_every_element_travels_once_and_messages_respect_the_limit():
    msgs = pair_messages([_bucket("send", OPS)], message_bytes=1024, solo_bytes=256)
    cov = _covered(msgs)
    for name, _offset, shape in OPS:
        assert len(cov[name]) == math.prod(shape), name
    assert max(m.nbytes for m in msgs) <= 1024
    # the two small ops share one staged message, 16-byte aligned
    staged = [m for m in msgs if not m.solo]
    assert len(staged) == 1 and [o.name for o in staged[0].ops] == ["small.a", "small.b"]
    assert all(o.byte_offset % 16 == 0 for o in staged[0].ops)
    assert [m.tag for m in msgs] == list(range(len(msgs)))


def test_chunks_are_contiguous_row_ranges_of_the_op():
    msgs = pair_messages([_bucket("send", [OPS[0]])], message_bytes=2048, solo_bytes=1)
    assert all(m.solo and len(m.ops) == 1 for m in msgs)
    rows = [(m.ops[0].offset[0], m.ops[0].shape[0]) for m in msgs]
    assert rows == [(r, min(10, 64 - r)) for r in range(0, 64, 10)]  # 10 rows of 200 bytes fit


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        pair_messages([_bucket("send", OPS)], message_bytes=0, solo_bytes=1)
