"""The native resharding planner: table-driven cases, every error path, determinism, balancing,
bucket splitting, stats. Helpers here (exact-cover check from the ops alone, local tensors for
`simulate`) are shared with test_plan_property.py and test_plan_layouts.py."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from awex_fast.meta import ParameterMeta, ShardMeta, ShardRule
from awex_fast.plan import PlanError, build_plan
from awex_fast.plan import planner as P
from awex_fast.transfer import simulate

# ---------------------------------------------------------------------------------------------
# helpers


def pieces_by_rank(metas):
    """{(rank, name): [ShardMeta]} with rules expanded by meta.py (the reference expansion)."""
    out = defaultdict(list)
    for m in metas:
        for s in m.pieces():
            if math.prod(s.shape) or not s.shape:
                out[s.rank, m.name].append(s)
    return out


def local_extent(pieces, ndim):
    ext = [0] * ndim
    for s in pieces:
        for d in range(ndim):
            ext[d] = max(ext[d], s.local[d] + s.shape[d])
    return tuple(ext)


def _contains(piece, local_off, shape):
    """Global offset of a local box inside ``piece``, or None."""
    g = []
    for d in range(len(shape)):
        lo = local_off[d] - piece.local[d]
        if lo < 0 or lo + shape[d] > piece.shape[d]:
            return None
        g.append(piece.global_offset[d] + lo)
    return tuple(g)


def rank_ops(rp, kind):
    """(peer, name, src_off, dst_off, shape, byte_offset, nbytes, bucket seq) of one direction."""
    out = []
    for b in rp.sends if kind == P.SEND else rp.recvs:
        for op in b.ops:
            out.append(
                (b.peer, op.name, op.src_offset, op.dst_offset, op.shape, op.byte_offset, op.nbytes, b.seq)
            )
    return out


def check_exact_cover(plan, train, infer):
    """From the ops alone: every element of every inference piece is written exactly once, by an
    op whose source box lies inside a piece of the sending rank holding the same global elements;
    every bucket fits; the senders' ops are exactly the receivers' ops."""
    tp, ip = pieces_by_rank(train), pieces_by_rank(infer)
    ndim = {m.name: len(m.global_shape) for m in infer}
    counts = {k: np.zeros(local_extent(v, ndim[k[1]]), np.int32) for k, v in ip.items()}
    received, sent = [], []
    for r in plan.receivers:
        rp = plan.for_rank(r)
        for b in rp.recvs:
            assert b.nbytes <= plan.bucket_bytes
            assert sum(op.nbytes for op in b.ops) == b.payload
        for peer, name, src, dst, shape, off, nb, seq in rank_ops(rp, P.RECV):
            g_dst = [g for s in ip[r, name] if (g := _contains(s, dst, shape)) is not None]
            assert g_dst, f"rank {r} {name}: dst box {dst}+{shape} is in no piece of the receiver"
            g_src = [g for s in tp[peer, name] if (g := _contains(s, src, shape)) is not None]
            assert g_dst[0] in g_src, f"{name}: rank {peer} does not hold {g_dst[0]}+{shape} at {src}"
            counts[r, name][tuple(slice(o, o + n) for o, n in zip(dst, shape, strict=True))] += 1
            received.append((peer, r, name, src, dst, shape, off, nb, seq))
    for s in plan.senders:
        rp = plan.for_rank(s)
        for b in rp.sends:
            assert b.nbytes <= plan.bucket_bytes
        sent += [(s, peer, name, src, dst, shape, off, nb, seq)
                 for peer, name, src, dst, shape, off, nb, seq in rank_ops(rp, P.SEND)]
    assert sorted(sent) == sorted(received)
    for (r, name), c in counts.items():
        mask = np.zeros_like(c, dtype=bool)
        for s in ip[r, name]:
            mask[tuple(slice(o, o + n) for o, n in zip(s.local, s.shape, strict=True))] = True
        times = sorted(set(c[mask].tolist()))
        assert (c[mask] == 1).all(), f"rank {r} {name}: elements written {times} times"
        assert (c[~mask] == 0).all(), f"rank {r} {name}: writes outside its pieces"


def global_tensors(metas, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {m.name: torch.randn(m.global_shape, generator=g, dtype=torch.float32) for m in metas}


def local_tensors(metas, full, fill=None):
    """{rank: {name: local tensor}} holding each piece's slice of ``full`` (cast to the side's
    dtype), or ``fill`` everywhere when given."""
    out = defaultdict(dict)
    for (r, name), pcs in pieces_by_rank(metas).items():
        if name not in full:
            continue
        m = next(x for x in metas if x.name == name)
        dt = getattr(torch, m.dtype)
        value = float("nan") if fill is None else fill
        t = torch.full(local_extent(pcs, len(m.global_shape)), value, dtype=dt)
        if fill is None:
            for s in pcs:
                t[_slices(s.local, s.shape)] = full[name][_slices(s.global_offset, s.shape)].to(dt)
        out[r][name] = t
    return out


def _slices(off, shape):
    return tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))


def check_simulated(plan, train, infer, seed=0):
    """simulate() and compare every inference piece with the global tensor cast the way the
    data travels (training dtype, then the receiver's): bitwise."""
    full = global_tensors(infer, seed)
    tt = local_tensors(train, full)
    it = local_tensors(infer, full, fill=float("nan"))
    stats = simulate(plan, tt, it)
    tdt = {m.name: getattr(torch, m.dtype) for m in train}
    for (r, name), pcs in pieces_by_rank(infer).items():
        local = it[r][name]
        for s in pcs:
            want = full[name][_slices(s.global_offset, s.shape)].to(tdt[name]).to(local.dtype)
            assert torch.equal(local[_slices(s.local, s.shape)], want), (r, name, s)
    return stats


def meta(name, shape, dtype="float32", shards=(), rules=()):
    return ParameterMeta(name, shape, dtype, tuple(shards), tuple(rules))


def S(rank, off, shape, loc=None):
    return ShardMeta(rank, off, shape, loc)


# ---------------------------------------------------------------------------------------------
# table-driven cases: (id, training metas, inference metas, {receiver: [(peer, src, dst, shape)]})

CASES = [
    (
        "same TP2 split: one op each, from the same chunk",
        [meta("w", (4, 6), rules=[ShardRule((2, 3), (0,), (2,))])],
        [meta("w", (4, 6), rules=[ShardRule((0, 1), (0,), (2,))])],
        {0: [(2, (0, 0), (0, 0), (2, 6))], 1: [(3, (0, 0), (0, 0), (2, 6))]},
    ),
    (
        "column split to row split: every receiver gets a piece of each sender",
        [meta("w", (4, 6), rules=[ShardRule((2, 3), (1,), (2,))])],
        [meta("w", (4, 6), rules=[ShardRule((0, 1), (0,), (2,))])],
        {
            0: [(2, (0, 0), (0, 0), (2, 3)), (3, (0, 0), (0, 3), (2, 3))],
            1: [(2, (2, 0), (0, 0), (2, 3)), (3, (2, 0), (0, 3), (2, 3))],
        },
    ),
    (
        "uneven chunks: 7 rows over 4 ranks (2, 2, 2, 1) into 2 (4, 3)",
        [meta("w", (7, 3), rules=[ShardRule((2, 3, 4, 5), (0,), (4,))])],
        [meta("w", (7, 3), rules=[ShardRule((0, 1), (0,), (2,))])],
        {
            0: [(2, (0, 0), (0, 0), (2, 3)), (3, (0, 0), (2, 0), (2, 3))],
            1: [(4, (0, 0), (0, 0), (2, 3)), (5, (0, 0), (2, 0), (1, 3))],
        },
    ),
    (
        "explicit pieces with local offsets on both sides (a fused local tensor)",
        [meta("q", (2, 4), shards=[S(3, (0, 0), (2, 4), (1, 0))]),
         meta("k", (1, 4), shards=[S(3, (0, 0), (1, 4), (0, 0))])],
        [meta("q", (2, 4), shards=[S(0, (0, 0), (2, 2), (0, 0)), S(1, (0, 2), (2, 2), (0, 0))]),
         meta("k", (1, 4), shards=[S(0, (0, 0), (1, 2), (2, 0)), S(1, (0, 2), (1, 2), (2, 0))])],
        {
            0: [(3, (0, 0), (2, 0), (1, 2)), (3, (1, 0), (0, 0), (2, 2))],
            1: [(3, (0, 2), (2, 0), (1, 2)), (3, (1, 2), (0, 0), (2, 2))],
        },
    ),
    (
        "small replicated tensor: consecutive receivers of one box take turns over the replicas",
        [meta("b", (8,), rules=[ShardRule((4, 5), (), (), replicas=2)])],
        [meta("b", (8,), rules=[ShardRule((0, 1, 2, 3), (), (), replicas=4)])],
        None,  # checked below: sources alternate
    ),
    (
        "0-d scalar",
        [meta("s", (), shards=[S(2, (), ())])],
        [meta("s", (), shards=[S(0, (), ()), S(1, (), ())])],
        {0: [(2, (), (), ())], 1: [(2, (), (), ())]},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_table(case):
    _, train, infer, want = case
    plan = build_plan(train, infer)
    check_exact_cover(plan, train, infer)
    check_simulated(plan, train, infer)
    if want is not None:
        for r, ops in want.items():
            recv = rank_ops(plan.for_rank(r), P.RECV)
            got = [(peer, src, dst, shape) for peer, _n, src, dst, shape, *_ in recv]
            assert got == ops


def test_small_replicated_alternates_sources():
    plan = build_plan(CASES[4][1], CASES[4][2])
    sources = [plan.for_rank(r).recvs[0].peer for r in range(4)]
    assert sorted(sources) == [4, 4, 5, 5]
    assert plan.stats()["imbalance"] == 1.0


def test_cast_and_train_only_names():
    train = [meta("w", (4, 4), "float32", rules=[ShardRule((2,))]),
             meta("optimizer_only", (3,), "float32", rules=[ShardRule((2,))])]
    infer = [meta("w", (4, 4), "bfloat16", rules=[ShardRule((0, 1), (1,), (2,))])]
    plan = build_plan(train, infer)
    st = plan.stats()
    assert st["train_only_names"] == ["optimizer_only"] and plan.train_only == ("optimizer_only",)
    assert st["total_bytes"] == 16 * 2 and st["params"] == 1
    op = plan.for_rank(0).recvs[0].ops[0]
    assert (op.src_dtype, op.dst_dtype, op.nbytes) == ("float32", "bfloat16", 16)
    check_simulated(plan, train, infer)


# ---------------------------------------------------------------------------------------------
# errors


def _err(train, infer, match, **kw):
    with pytest.raises(PlanError, match=match):
        build_plan(train, infer, **kw)


def test_error_missing_on_training_side():
    _err([meta("a", (2,), rules=[ShardRule((1,))])],
         [meta("a", (2,), rules=[ShardRule((0,))]), meta("b", (2,), rules=[ShardRule((0,))])],
         "'b' is needed by the inference side but missing on the training side")


def test_error_shape_mismatch():
    _err([meta("w", (4, 2), rules=[ShardRule((1,))])], [meta("w", (2, 4), rules=[ShardRule((0,))])],
         r"'w'.*global shape \(2, 4\) does not match the training side's \(4, 2\)")
    _err([meta("w", (4,), rules=[ShardRule((1,))])], [meta("w", (4, 1), rules=[ShardRule((0,))])],
         r"'w'.*does not match")


def test_error_rank_on_both_sides():
    _err([meta("w", (4,), rules=[ShardRule((1,))])], [meta("w", (4,), rules=[ShardRule((0, 1), (0,), (2,))])],
         r"transfer rank 1 appears on both sides.*'w'")


def test_error_uncovered_region():
    train = [meta("w", (4, 4), shards=[S(5, (0, 0), (2, 4)), S(6, (2, 0), (2, 2))])]
    infer = [meta("w", (4, 4), rules=[ShardRule((0, 1), (1,), (2,))])]
    _err(train, infer, r"'w': inference rank 1 needs the region at global offset \(2, 2\) shape \(2, 2\)")
    # A hole that no inference piece needs is fine.
    ok = build_plan(train, [meta("w", (4, 4), shards=[S(0, (0, 0), (4, 2))])])
    check_exact_cover(ok, train, [meta("w", (4, 4), shards=[S(0, (0, 0), (4, 2))])])


def raw(name, shape, dtype="float32", shards=(), rules=()):
    """A duck-typed meta that skips meta.py's own validation, to reach the planner's."""
    return SimpleNamespace(name=name, global_shape=shape, dtype=dtype, shards=shards, rules=rules)


def raw_shard(rank, off, shape, loc=None):
    return SimpleNamespace(rank=rank, global_offset=off, shape=shape, local_offset=loc)


def raw_rule(ranks, dims=(), chunks=(), replicas=1, loc=None):
    return SimpleNamespace(
        ranks=ranks, split_dims=dims, num_chunks=chunks, replicas=replicas, local_offset=loc
    )


@pytest.mark.parametrize(
    ("train", "match"),
    [
        ([raw("w", (4,), shards=[raw_shard(1, (2,), (4,))])], r"'w' \(training side\).*outside the global"),
        ([raw("w", (4,), shards=[raw_shard(1, (0, 0), (4, 1))])], r"'w'.*wrong length"),
        ([raw("w", (4,), shards=[raw_shard(-1, (0,), (4,))])], r"'w'.*ranks must be in"),
        ([raw("w", (4,), shards=[raw_shard(1, (0,), (4,), (-1,))])], r"'w'.*negative local offset"),
        ([raw("w", (4,), rules=[raw_rule((1, 2), (1,), (2,))])], r"'w'.*splits dim 1"),
        ([raw("w", (4,), rules=[raw_rule((1, 2, 3), (0,), (2,))])], r"'w'.*lists 3 ranks, expected"),
        ([raw("w", (4,), rules=[raw_rule((1, 2), (0,), (0,))])], r"'w'.*num_chunks must be >= 1"),
        ([raw("w", (4,), rules=[raw_rule((1,), replicas=0)])], r"'w'.*replicas must be >= 1"),
        ([raw("w", (4,), rules=[raw_rule((1,), loc=(0, 0))])], r"'w'.*local_offset of length 2"),
        ([raw("w", (-4,), rules=[raw_rule((1,))])], r"'w'.*negative global shape"),
        ([raw("w", (4,), shards=[raw_shard("x", (0,), (4,))])], r"'w'.*shard rank must be integers"),
        ([raw("w", (4,), rules=[raw_rule((1,))]), raw("w", (4,), "float16", rules=[raw_rule((2,))])],
         r"'w'.*conflicting duplicate entries"),
        ([raw("w", (4,), "complex7", rules=[raw_rule((1,))])], r"'w': unknown dtype 'complex7'"),
    ],
)
def test_error_malformed_pieces_and_rules(train, match):
    _err(train, [meta("w", (4,), rules=[ShardRule((0,))])], match)


def test_error_bucket_bytes_and_rank():
    train, infer = [meta("w", (4,), rules=[ShardRule((1,))])], [meta("w", (4,), rules=[ShardRule((0,))])]
    _err(train, infer, "bucket_bytes 2 is smaller than one element", bucket_bytes=2)
    _err(train, infer, "bucket_bytes must be positive", bucket_bytes=0)
    with pytest.raises(PlanError, match="non-negative"):
        build_plan(train, infer).for_rank(-1)


def test_duck_typed_metas_and_torch_dtypes():
    class Shard:
        def __init__(self, rank, off, shape):
            self.rank, self.global_offset, self.shape, self.local_offset = rank, off, shape, None

    class Meta:
        def __init__(self, name, shape, dtype, shards):
            self.name, self.global_shape, self.dtype, self.shards, self.rules = name, shape, dtype, shards, ()

    train = [Meta("w", [4, 2], torch.float32, [Shard(2, [0, 0], [4, 2])])]
    infer = [Meta("w", (4, 2), "half", (Shard(0, (0, 0), (2, 2)), Shard(1, (2, 0), (2, 2))))]
    plan = build_plan(train, infer)
    assert plan.for_rank(1).recvs[0].ops[0].dst_dtype == "float16"

    class Broken(Meta):
        @property
        def shards(self):
            raise RuntimeError("no shards here")

        @shards.setter
        def shards(self, v):
            pass

    with pytest.raises(PlanError, match=r"'w' .*cannot read shards: no shards here"):
        build_plan([Broken("w", (4, 2), "float32", ())], infer)


# ---------------------------------------------------------------------------------------------
# determinism


def _shuffled(metas, rng):
    out = []
    for m in metas:
        shards = list(m.shards)
        rng.shuffle(shards)
        rules = list(m.rules)
        rng.shuffle(rules)
        out.append(ParameterMeta(m.name, m.global_shape, m.dtype, tuple(shards), tuple(rules)))
    rng.shuffle(out)
    return out


def _split_rows(metas):
    """The same metadata as per-rank lists would arrive: one row per (name, piece)."""
    out = []
    for m in metas:
        for s in m.shards:
            out.append(ParameterMeta(m.name, m.global_shape, m.dtype, (s,), ()))
        for r in m.rules:
            out.append(ParameterMeta(m.name, m.global_shape, m.dtype, (), (r,)))
    return out


def _det_world():
    train = [
        meta("layers.0.w", (6, 10), rules=[ShardRule(tuple(range(8, 14)), (0, 1), (3, 2))]),
        meta("layers.0.b", (10,), shards=[S(8, (0,), (5,)), S(9, (5,), (5,)), S(10, (0,), (10,))]),
        meta("layers.1.w", (9, 4), rules=[ShardRule((8, 9), (0,), (2,)), ShardRule((12, 13), (0,), (2,))]),
        meta("extra", (3,), rules=[ShardRule((8,))]),
    ]
    infer = [
        meta("layers.0.w", (6, 10), "bfloat16", rules=[ShardRule((0, 1, 2, 3), (1,), (2,), replicas=2)]),
        meta("layers.0.b", (10,), "bfloat16", rules=[ShardRule((0, 1, 2, 3), (), (), replicas=4)]),
        meta("layers.1.w", (9, 4), "bfloat16", shards=[S(r, (0, 0), (9, 4)) for r in range(4)]),
    ]
    return train, infer


def test_determinism_under_shuffles_and_splits():
    train, infer = _det_world()
    base = build_plan(train, infer, bucket_bytes=64)
    want = {r: (base.for_rank(r).ops.tolist(), base.for_rank(r).buckets.tolist()) for r in range(14)}
    rng = random.Random(7)
    for variant in range(4):
        t = _shuffled(train, rng) if variant % 2 == 0 else _split_rows(_shuffled(train, rng))
        i = _shuffled(infer, rng) if variant < 2 else _split_rows(infer)
        plan = build_plan(t, i, bucket_bytes=64)
        assert plan.digest() == base.digest()
        assert plan.names == base.names
        for r in range(14):
            rp = plan.for_rank(r)
            assert (rp.ops.tolist(), rp.buckets.tolist()) == want[r]
    check_exact_cover(base, train, infer)
    check_simulated(base, train, infer)


def test_digest_changes_with_what_it_covers():
    train, infer = _det_world()
    d = build_plan(train, infer).digest()
    assert len(d) == 32 and int(d, 16) >= 0
    assert build_plan(train, infer, bucket_bytes=1 << 20).digest() != d
    full = [S(r, (0, 0), (9, 4)) for r in range(4)]
    other = [*infer[:2], meta("layers.1.w", (9, 4), "float16", shards=full)]
    assert build_plan(train, other).digest() != d
    moved = [*train[:3], meta("extra", (3,), rules=[ShardRule((9,))])]
    assert build_plan(moved, infer).digest() != d
    assert build_plan(train, infer).digest() == d


# ---------------------------------------------------------------------------------------------
# balancing, buckets, stats


def test_balancing_dp4_replicas():
    # 4 full training replicas (TP2 each), one inference engine of TP2: each region is held by
    # 4 ranks; every training rank must send a quarter.
    dp4 = ShardRule(tuple(range(2, 10)), (0,), (2,), replicas=4)
    train = [meta(f"w{i}", (1024, 256), "float32", rules=[dp4]) for i in range(3)]
    infer = [meta(f"w{i}", (1024, 256), "float32", rules=[ShardRule((0, 1), (1,), (2,))]) for i in range(3)]
    plan = build_plan(train, infer)
    st = plan.stats()
    assert st["senders"] == 8 and st["imbalance"] <= 1.05 and st["imbalance_even"] <= 1.05
    assert st["total_bytes"] == 3 * 1024 * 256 * 4
    assert st["send_bytes_max"] - st["send_bytes_mean"] <= 0.05 * st["send_bytes_mean"]
    check_exact_cover(plan, train, infer)


def test_balancing_many_small_tensors_and_engines():
    # Small tensors (below MIN_PART_BYTES) go whole to one replica; rotation spreads them.
    train = [meta(f"n{i}", (64,), "float32", rules=[ShardRule(tuple(range(8, 12)), (), (), replicas=4)])
             for i in range(64)]
    infer = [meta(f"n{i}", (64,), "float32", rules=[ShardRule(tuple(range(8)), (), (), replicas=8)])
             for i in range(64)]
    st = build_plan(train, infer).stats()
    assert st["imbalance"] <= 1.05, st["per_rank_send"]


def test_bucket_splitting_rows_and_inside_rows():
    train = [meta("big", (10, 6), "float32", rules=[ShardRule((1,))]),
             meta("wide", (2, 50), "float32", rules=[ShardRule((1,))]),
             meta("tiny", (3,), "float32", rules=[ShardRule((1,))])]
    infer = [meta(m.name, m.global_shape, "float32", rules=[ShardRule((0,))]) for m in train]
    plan = build_plan(train, infer, bucket_bytes=100)  # 4 rows of "big" (24 B each); a "wide" row is 200 B
    rp = plan.for_rank(0)
    assert all(b.nbytes <= 100 for b in rp.recvs)
    big = [op for b in rp.recvs for op in b.ops if op.name == "big"]
    assert [op.shape for op in big] == [(4, 6), (4, 6), (2, 6)]
    wide = [op for b in rp.recvs for op in b.ops if op.name == "wide"]
    assert [(op.dst_offset, op.shape) for op in wide] == [
        ((r, c), (1, min(25, 50 - c))) for r in range(2) for c in range(0, 50, 25)
    ]
    # Ops start 16-byte aligned and back to back inside a bucket.
    for b in rp.recvs:
        end = 0
        for op in b.ops:
            assert op.byte_offset % P.OP_ALIGN == 0 and op.byte_offset >= end
            end = op.byte_offset + op.nbytes
        assert end == b.nbytes
    st = plan.stats()
    assert st["buckets"] == len(rp.recvs) and st["ops"] == len(rp.ops)
    check_exact_cover(plan, train, infer)
    check_simulated(plan, train, infer)


def test_stats_match_per_rank_plans():
    train, infer = _det_world()
    plan = build_plan(train, infer, bucket_bytes=48)
    st = plan.stats()
    ranks = plan.receivers + plan.senders
    rps = {r: plan.for_rank(r) for r in ranks}
    assert st["ops"] == sum(len(rps[r].ops) for r in plan.receivers)
    assert st["buckets"] == sum(len(rps[r].recvs) for r in plan.receivers)
    assert st["total_bytes"] == sum(rps[r].recv_bytes for r in plan.receivers)
    assert st["wire_bytes"] == sum(b.nbytes for r in plan.receivers for b in rps[r].recvs)
    assert st["per_rank_send"] == {r: rps[r].send_bytes for r in plan.senders if r in st["per_rank_send"]}
    assert st["pairs"] == len({(r, b.peer) for r in plan.receivers for b in rps[r].recvs})
    assert st["recv_bytes_max"] == max(rps[r].recv_bytes for r in plan.receivers)
    assert st["digest"] == plan.digest()


def test_rank_plan_arrays_and_views():
    train, infer = _det_world()
    plan = build_plan(train, infer, bucket_bytes=64)
    rp = plan.for_rank(1)
    assert rp.ops.shape[1] == P.OP_BOXES + 3 * plan.max_ndim and not rp.ops.flags.writeable
    assert rp.buckets.shape[1] == P.BUCKET_COLS
    for b in rp.recvs:
        rows = rp.ops[b.rows]
        assert (rows[:, P.OP_KIND] == P.RECV).all() and (rows[:, P.OP_PEER] == b.peer).all()
        assert len(b.ops) == len(rows) and b.ops[-1] == b.ops[len(b.ops) - 1]
        assert [op.nbytes for op in b.ops] == rows[:, P.OP_NBYTES].tolist()
    assert plan.for_rank(999).sends == [] and plan.for_rank(999).recvs == []
