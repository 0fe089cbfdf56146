"""Planner at cluster scale: explicit shard lists packed once by `merge_metas` (csrc/plan
pack_shards) plan exactly as the same lists read piece by piece, and parameter sizes past the
planner's int64 limits raise `PlanError` naming the parameter instead of overflowing."""

from __future__ import annotations

import dataclasses
import gc
import random
import time

import numpy as np
import pytest

from awex_fast.layouts import model_spec
from awex_fast.layouts.synthetic import world_metas
from awex_fast.meta import ParameterMeta, ShardMeta, merge_metas
from awex_fast.meta.merge import _shard_key
from awex_fast.plan import PlanError, build_plan

# ---------------------------------------------------------------------------------------------
# packed explicit lists


def per_rank_lists(metas):
    """Each rank's own explicit pieces (rules expanded), as metas_from_dtensors reports them."""
    per: dict[int, list[ParameterMeta]] = {}
    for m in metas:
        by: dict[int, list[ShardMeta]] = {}
        for s in m.pieces():
            by.setdefault(s.rank, []).append(s)
        for r, ss in by.items():
            per.setdefault(r, []).append(ParameterMeta(m.name, m.global_shape, m.dtype, tuple(ss)))
    return per


def unpacked(metas):
    """Copies without the packed records: build_plan reads them piece by piece."""
    out = [dataclasses.replace(m) for m in metas]
    assert all(m._shard_pack is None for m in out)
    return out


def test_merge_packs_and_keeps_the_python_order_and_dedupe():
    rng = random.Random(5)
    lists = []
    for _ in range(6):
        shards = []
        for _ in range(5):
            row = rng.randrange(4)
            loc = rng.choice([None, (0, 0), (1, 0)])
            shards.append(ShardMeta(rng.randrange(3), (row, 0), (1, 4), loc))
        lists.append([ParameterMeta("w", (4, 4), "float32", tuple(shards))])
    merged = merge_metas(lists)[0]
    every = [s for lst in lists for s in lst[0].shards]
    expect = tuple(sorted(dict.fromkeys(every), key=_shard_key))
    assert merged.shards == expect
    assert [id(s) for s in merged.shards] == [id(next(e for e in every if e == s)) for s in expect]
    assert merged._shard_pack is not None and merged._shard_pack[0] is merged.shards


def test_packed_and_unpacked_explicit_lists_plan_identically():
    spec = model_spec("qwen2.5-0.5b")
    train, infer = world_metas(spec, "tp2,dp2", "tp2,engines2")
    et, ei = merge_metas(per_rank_lists(train)), merge_metas(per_rank_lists(infer))
    assert all(m._shard_pack is not None for m in et + ei)
    fast, slow = build_plan(et, ei, 1 << 20), build_plan(unpacked(et), unpacked(ei), 1 << 20)
    assert fast.digest() == slow.digest()
    for r in fast.senders + fast.receivers:
        a, b = fast.for_rank(r), slow.for_rank(r)
        assert np.array_equal(a.ops, b.ops) and np.array_equal(a.buckets, b.buckets)
    assert fast.stats()["total_bytes"] == slow.stats()["total_bytes"]


def test_a_plan_outlives_the_packed_metas_it_reads_in_place():
    # The native World reads merge_metas' packed records in place; the plan holds them, so it
    # plans the same after every metadata object is gone.
    spec = model_spec("qwen2.5-0.5b")
    train, infer = world_metas(spec, "tp2,dp2", "tp2,engines2")
    et, ei = merge_metas(per_rank_lists(train)), merge_metas(per_rank_lists(infer))
    ref = build_plan(unpacked(et), unpacked(ei), 1 << 20)
    plan = build_plan(et, ei, 1 << 20)
    del et, ei
    gc.collect()
    junk = [bytes(range(256)) * 64 for _ in range(2000)]  # reuse any freed memory
    assert plan.digest() == ref.digest() and len(junk) == 2000
    for r in ref.senders + ref.receivers:
        assert np.array_equal(plan.for_rank(r).ops, ref.for_rank(r).ops)
    assert plan.stats()["total_bytes"] == ref.stats()["total_bytes"]


def test_a_stale_pack_is_ignored():
    m = merge_metas([[ParameterMeta("w", (4, 4), "float32", (ShardMeta(1, (0, 0), (4, 4)),))]])[0]
    inf = ParameterMeta("w", (4, 4), "float32", (ShardMeta(0, (0, 0), (4, 4)),))
    want = build_plan([m], [inf]).digest()
    # A pack that does not belong to this shards tuple (e.g. copied onto another object).
    other = ParameterMeta("w", (4, 4), "float32", (ShardMeta(2, (0, 0), (4, 4)),))
    object.__setattr__(other, "_shard_pack", m._shard_pack)
    assert build_plan([other], [inf]).digest() != want
    assert 2 in build_plan([other], [inf]).senders


def test_unpackable_shards_fall_back_and_still_name_the_parameter():
    huge = ShardMeta(2**70, (0,), (4,))
    m = merge_metas([[ParameterMeta("w", (4,), "float32", (huge,))]])[0]
    assert m._shard_pack is None
    with pytest.raises(PlanError, match="'w'"):
        build_plan([m], [ParameterMeta("w", (4,), "float32", (ShardMeta(0, (0,), (4,)),))])


# ---------------------------------------------------------------------------------------------
# int64 limits (issue 22, item 3)


def one_piece(name, shape, dtype, rank):
    return ParameterMeta(name, shape, dtype, (ShardMeta(rank, (0,) * len(shape), shape),))


@pytest.mark.parametrize(
    ("shape", "train_dtype", "infer_dtype"),
    [
        ((2**31, 2**31), "float32", "bfloat16"),  # 2^64 training bytes: total_bytes was -2^63
        ((2**62, 4), "float32", "float32"),  # 2^64 elements: total_bytes was 0
        ((2**60,), "float64", "float64"),  # stats() took 28 s, for_rank allocated until killed
        ((2**46, 2, 2), "bfloat16", "bfloat16"),  # 2^49 bytes: just past the limit
    ],
)
def test_parameters_past_the_limit_raise_naming_the_parameter(shape, train_dtype, infer_dtype):
    t0 = time.perf_counter()
    with pytest.raises(PlanError, match=r"'layers\.0\.big'.*2\^48 bytes"):
        build_plan([one_piece("layers.0.big", shape, train_dtype, 1)],
                   [one_piece("layers.0.big", shape, infer_dtype, 0)])  # fmt: skip
    assert time.perf_counter() - t0 < 1.0


def test_a_parameter_at_the_limit_plans_with_exact_counts():
    shape = (2**23, 2**24)  # 2^47 bfloat16 elements: 2^48 bytes, the limit itself
    plan = build_plan([one_piece("w", shape, "bfloat16", 1)], [one_piece("w", shape, "bfloat16", 0)],
                      bucket_bytes=1 << 40)  # fmt: skip
    st = plan.stats()
    assert st["total_bytes"] == 2**48 and st["buckets"] == 2**8
    assert plan.for_rank(0).recv_bytes == 2**48


def test_the_world_total_is_limited_too():
    shape = (2**23, 2**24)  # 2^48 bytes each: 2^14 of them reach 2^62
    train = [one_piece(f"p{i:05d}", shape, "bfloat16", 1) for i in range(2**14 + 1)]
    infer = [one_piece(f"p{i:05d}", shape, "bfloat16", 0) for i in range(2**14 + 1)]
    with pytest.raises(PlanError, match=r"'p16384'.*2\^62"):
        build_plan(train, infer)


def test_a_piece_whose_end_overflows_is_refused():
    shape = (2**40,)
    bad = ParameterMeta("w", shape, "int8", (ShardMeta(1, (2**40 - 1,), (2**63 - 2**40 + 2,)),))
    with pytest.raises(PlanError, match=r"'w'.*outside the global shape"):
        build_plan([bad], [one_piece("w", shape, "int8", 0)])


# ---------------------------------------------------------------------------------------------
# awex-fast plan --link-gbps


def test_cli_projects_the_sync_time(capsys):
    from awex_fast.cli import FP8_SCALE_OVERHEAD, plan_main

    argv = ["--model", "qwen2.5-0.5b", "--train", "tp2,dp2", "--infer", "tp2,engines2"]
    assert plan_main([*argv, "--json", "--link-gbps", "80", "--nics-per-rank", "2"]) == 0
    out = __import__("json").loads(capsys.readouterr().out)
    proj, rate = out["projection"], 80e9 / 8 * 2
    assert proj["recv_s"] == pytest.approx(out["recv_bytes_max"] / rate)
    assert proj["send_s"] == pytest.approx(out["send_bytes_max"] / rate)
    assert proj["projected_s"] == max(proj["send_s"], proj["recv_s"])
    assert proj["bound_s"] <= proj["projected_s"] + 1e-12
    assert plan_main([*argv[:-1], "tp2,engines2,dtype=float8_e4m3fn", "--json", "--link-gbps", "80"]) == 0
    fp8 = __import__("json").loads(capsys.readouterr().out)
    want = fp8["recv_bytes_max"] * (1 + FP8_SCALE_OVERHEAD) / 1e10
    assert fp8["projection"]["recv_s"] == pytest.approx(want)
    assert plan_main([*argv, "--link-gbps", "80"]) == 0
    assert "projected sync time" in capsys.readouterr().out
    assert plan_main([*argv, "--link-gbps", "0"]) == 2


def test_packed_rows_with_empty_or_bad_pieces_take_the_checked_path():
    empty = ShardMeta(3, (0, 0), (0, 4))
    full = ShardMeta(1, (0, 0), (4, 4))
    m = merge_metas([[ParameterMeta("w", (4, 4), "float32", (full, empty))]])[0]
    assert m._shard_pack is not None
    inf = [ParameterMeta("w", (4, 4), "float32", (ShardMeta(0, (0, 0), (4, 4)),))]
    assert build_plan([m], inf).digest() == build_plan(unpacked([m]), inf).digest()
    assert build_plan([m], inf).senders == [1]
    bad = merge_metas([[ParameterMeta("w", (4, 4), "float32", (ShardMeta(1, (2, 0), (4, 4)),))]])[0]
    assert bad._shard_pack is not None
    with pytest.raises(PlanError, match=r"'w'.*rank 1 at offset \(2, 0\).*outside the global shape"):
        build_plan([bad], inf)
