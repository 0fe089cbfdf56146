"""build_plan refuses, at plan time and naming the parameter, what used to plan and then go
wrong: pieces of one rank that overlap (simulate wrote wrong data) and dtype pairs the copy layer
cannot cast (the sender failed mid-update, its receiver waited out its timeout)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_plan import check_simulated
from test_plan_property import hostile_worlds

from awex_fast.meta import MetadataError, ParameterMeta, ShardMeta, ShardRule, validate_metas
from awex_fast.plan.planner import (
    _DTYPE_CODE,
    _ITEMSIZES,
    DTYPES,
    PlanError,
    _dtype_fallback,
    _plan,
    build_plan,
)
from awex_fast.transfer import boxcopy as afc

S = ShardMeta


def _w(shape, dtype="float32", shards=(), rules=()):
    return ParameterMeta("w", shape, dtype, tuple(shards), tuple(rules))


def test_overlapping_inference_pieces_of_one_rank_are_refused():
    # Issue 22 item 2: two global boxes of rank 0 sharing local rows 2:4.
    train = [_w((8, 4), shards=[S(2, (0, 0), (8, 4))])]
    infer = [_w((8, 4), shards=[S(0, (0, 0), (4, 4)), S(0, (4, 0), (4, 4), (2, 0))])]
    with pytest.raises(PlanError, match=r"inference side: parameter 'w': rank 0 holds overlapping "
                                        r"pieces in local space: shards\[0\] box \[0:4, 0:4\] and "
                                        r"shards\[1\] box \[2:6, 0:4\]"):
        build_plan(train, infer, bucket_bytes=16)
    # The same pieces one local row block apart plan, and simulate exactly.
    ok = [_w((8, 4), shards=[S(0, (0, 0), (4, 4)), S(0, (4, 0), (4, 4), (4, 0))])]
    check_simulated(build_plan(train, ok, bucket_bytes=16), train, ok)


@pytest.mark.parametrize(
    ("train", "infer", "match"),
    [
        # one global box held twice by a training rank
        ([_w((4,), shards=[S(2, (0,), (4,)), S(2, (0,), (4,), (4,))])], [_w((4,), shards=[S(0, (0,), (4,))])],
         r"training side: parameter 'w': rank 2 holds overlapping pieces in global space"),
        # a rule's piece and an explicit piece of the same rank, in one local tensor
        ([_w((4,), shards=[S(2, (0,), (4,))])],
         [_w((4,), shards=[S(0, (2,), (2,))], rules=[ShardRule((0, 1), (0,), (2,))])],
         r"inference side: parameter 'w': rank 0 holds overlapping pieces in local space"),
        # entries of one name are merged first, as the planner merges them
        ([_w((4,), shards=[S(2, (0,), (2,))]), _w((4,), shards=[S(2, (2,), (2,))])],
         [_w((4,), shards=[S(0, (0,), (4,))])],
         r"training side: parameter 'w': rank 2 holds overlapping pieces in local space"),
    ],
)
def test_overlaps_on_either_side_are_refused(train, infer, match):
    with pytest.raises(PlanError, match=match):
        build_plan(train, infer)


def test_duck_typed_metas_are_validated_too():
    shard = lambda r, off, shape, loc=None: SimpleNamespace(rank=r, global_offset=off, shape=shape,  # noqa: E731
                                                            local_offset=loc)
    train = [SimpleNamespace(name="w", global_shape=(8,), dtype=torch.float32, rules=(),
                             shards=[shard(2, (0,), (8,))])]
    infer = [SimpleNamespace(name="w", global_shape=(8,), dtype="half", rules=(),
                             shards=[shard(0, (0,), (4,)), shard(0, (4,), (4,), (1,))])]
    with pytest.raises(PlanError, match="inference side: parameter 'w': rank 0 holds overlapping"):
        build_plan(train, infer)


CAST = set(afc.CAST_DTYPES)


@pytest.mark.parametrize(
    ("src", "dst"),
    [("float32", "int8"), ("int64", "float32"), ("float64", "float32"), ("float32", "float64"),
     ("float8_e4m3fn", "bfloat16"), ("bfloat16", "float8_e5m2"), ("int32", "uint32"), ("bool", "uint8")],
)
def test_cast_pairs_the_copy_layer_cannot_do_are_refused_at_plan_time(src, dst):
    ok = lambda r: ParameterMeta("ok", (2,), "float32", (S(r, (0,), (2,)),))  # noqa: E731
    train = [_w((4, 4), src, shards=[S(2, (0, 0), (4, 4))]), ok(2)]
    infer = [_w((4, 4), dst, shards=[S(0, (0, 0), (4, 4))]), ok(0)]
    with pytest.raises(PlanError, match=rf"parameter 'w': the training side holds {src} and the inference "
                                        rf"side {dst}, and the copy layer cannot cast {src} -> {dst}"):
        build_plan(train, infer)


def test_plan_time_cast_support_is_the_copy_layers_own_list():
    # One source of truth: the planner accepts exactly the pairs the copy layer accepts.
    assert afc.CAST_DTYPES == ("float32", "bfloat16", "float16")
    for src in DTYPES:
        for dst in DTYPES:
            train = [_w((2,), src, shards=[S(1, (0,), (2,))])]
            infer = [_w((2,), dst, shards=[S(0, (0,), (2,))])]
            try:
                build_plan(train, infer)
                planned = True
            except PlanError as exc:
                assert "cannot cast" in str(exc)
                planned = False
            try:
                afc.check_dtype_pair(getattr(torch, src), getattr(torch, dst))
                copyable = True
            except ValueError:
                copyable = False
            except AttributeError:  # a dtype this torch build does not name
                copyable = src == dst or {src, dst} <= CAST
            assert planned == copyable, (src, dst)


def test_supported_casts_plan_and_simulate():
    for src in sorted(CAST):
        for dst in sorted(CAST):
            train = [_w((4, 4), src, shards=[S(2, (0, 0), (4, 4))])]
            infer = [_w((4, 4), dst, rules=[ShardRule((0, 1), (1,), (2,))])]
            check_simulated(build_plan(train, infer, bucket_bytes=16), train, infer)


@settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_worlds())
def test_native_overlap_sweep_agrees_with_validate_metas(world):
    # build_plan runs validate_metas only where the native sweep (World.first_overlap) finds an
    # overlap, so the sweep must find every overlap validate_metas does (and, with one entry per
    # name, nothing else): checked against it as an independent oracle on hostile layouts.
    train, infer, _, _ = world
    try:
        native = _plan.World(train, infer, 1 << 20, _DTYPE_CODE, _ITEMSIZES, _dtype_fallback)
    except _plan.PlanError:
        return  # refused piece by piece before any overlap check
    for side, metas in ((0, train), (1, infer)):
        try:
            validate_metas(metas)
            overlap = False
        except MetadataError as exc:
            assert "overlapping" in str(exc), exc
            overlap = True
        assert (native.first_overlap(side) >= 0) == overlap, (side, metas)


def test_a_piece_reported_by_two_entries_of_one_name_is_one_piece():
    # Two ranks may report the same piece (merge_metas keeps one): the native sweep counts it
    # twice, validate_metas (after the merge) finds nothing, and the plan goes ahead as before.
    train = [_w((4,), shards=[S(2, (0,), (4,))]), _w((4,), shards=[S(2, (0,), (4,))])]
    infer = [_w((4,), shards=[S(0, (0,), (4,))])]
    check_simulated(build_plan(train, infer, bucket_bytes=16), train, infer)
