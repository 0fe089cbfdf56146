"""Plans over the named model shapes and generated layouts (awex_fast.layouts.models,
awex_fast.layouts.synthetic): end to end with real tensors on the tiny shapes, stats on the real
ones, the Kimi-K2-sized layout's JSON size, and the ``awex-fast plan`` command."""

from __future__ import annotations

import math

import pytest
from test_plan import check_exact_cover, check_simulated

from awex_fast.cli import main
from awex_fast.layouts import model_names, model_spec
from awex_fast.layouts.synthetic import (
    InferLayout,
    TrainLayout,
    parse_infer,
    parse_train,
    world_metas,
)
from awex_fast.meta import dtype_itemsize, metas_from_json, metas_to_json, validate_metas
from awex_fast.plan import build_plan


@pytest.mark.parametrize(
    ("model", "train", "infer"),
    [
        ("tiny-dense", "tp2,pp2,dp2", "tp2,engines2"),
        ("tiny-dense", "tp2,fsdp2,dp2", "tp4,engines1"),  # 2 KV heads over TP4: replicated heads
        ("tiny-dense", "fsdp4,dtype=float32", "tp2,engines3,dtype=bfloat16"),
        ("tiny-moe", "ep4,pp2", "tp2,engines2,ep"),
        ("tiny-moe", "tp2,ep2,etp2,dp2", "tp4,engines2"),
        ("tiny-mla", "ep2,pp2,fsdp2", "tp2,engines2"),
    ],
)
def test_tiny_models_move_exactly(model, train, infer):
    m = model_spec(model)
    tm, im = world_metas(m, train, infer)
    validate_metas(tm)  # the layouts themselves are well formed (meta.py's independent checks)
    validate_metas(im)
    plan = build_plan(tm, im, bucket_bytes=4096, min_part_bytes=256)
    check_exact_cover(plan, tm, im)
    stats = check_simulated(plan, tm, im)
    # Every inference piece arrives once, in the receiver's dtype.
    want = sum(math.prod(p.shape) * dtype_itemsize(x.dtype) for x in im for p in x.pieces())
    assert stats["bytes"] == want == plan.stats()["total_bytes"]


def test_layout_specs():
    assert parse_train("tp8,pp4,dp2") == TrainLayout(tp=8, pp=4, dp=2)
    assert parse_train("ep64,pp4").world_size == 256 and parse_train("ep64,pp4").dp == 64
    assert parse_infer("tp16,engines8,ep") == InferLayout(16, 8, True)
    for bad in ("tp0", "xx3", "tp2,engines2", "ep3,tp2"):
        with pytest.raises(ValueError, match="layout"):
            parse_train(bad)
    with pytest.raises(ValueError, match="only tp"):
        parse_infer("tp2,pp2")
    # embed, norm, lm_head + per layer: 2 norms, q/k/v/o, q/k norms, router, 64 x 3 experts
    assert len(model_spec("small-moe").tensors) == 3 + 8 * (2 + 4 + 2 + 1 + 64 * 3)
    assert model_spec("qwen2.5-7b", layers=2).num_layers == 2
    assert {"qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-235b-a22b", "kimi-k2", "small-moe"} <= set(
        model_names()
    )


def _rank_summary(plan, rank):
    rp = plan.for_rank(rank)
    return len(rp.ops), rp.send_bytes, len(rp.sends)


def test_qwen72b_balance_and_world_size_independence():
    m = model_spec("qwen2.5-72b")
    small = build_plan(*world_metas(m, "tp8,pp4,dp2", "tp8,engines8"))
    st = small.stats()
    # Each engine gets the model once, plus one copy per extra TP rank of every replicated tensor.
    replicated = sum(t.numel for t in m.tensors if t.tp_dim is None)
    per_engine = 2 * (m.num_params + 7 * replicated)
    assert st["total_bytes"] == 8 * per_engine and st["recv_bytes_max"] == st["recv_bytes_mean"]
    assert st["imbalance"] <= 1.05 and st["imbalance"] == pytest.approx(st["imbalance_bound"])
    assert st["senders"] == 64 and st["receivers"] == 64
    # 16x the ranks on both sides: a training rank still sends to 4 engines, so its own plan
    # (what for_rank computes) is the same size; only the metadata scan grows.
    big = build_plan(*world_metas(m, "tp8,pp4,dp16", "tp8,engines64"))
    assert len(big.senders) == 512 and len(big.receivers) == 512
    assert _rank_summary(big, 512) == _rank_summary(small, 64)
    assert big.stats()["imbalance"] <= 1.05


@pytest.fixture(scope="module")
def kimi():
    return world_metas(model_spec("kimi-k2"), "ep64,pp4", "tp16,engines8")


@pytest.mark.timeout(600)
def test_kimi_k2_layout_json_and_plan(kimi):
    train, infer = kimi
    assert len(train) == len(infer) > 69_000
    blob_t, blob_i = metas_to_json(train), metas_to_json(infer)
    assert len(blob_t) + len(blob_i) < 64 << 20, (len(blob_t), len(blob_i))
    plan = build_plan(metas_from_json(blob_t), metas_from_json(blob_i))
    assert plan.digest() == build_plan(train, infer).digest()
    rp = plan.for_rank(0)  # one inference rank: 1/16 of every tensor
    assert len({op.name for b in rp.recvs for op in b.ops}) == len(infer)
    st = plan.stats()
    assert st["senders"] == 256 and st["receivers"] == 128 and st["imbalance"] <= 1.05


def test_cli_plan(capsys):
    assert main(["plan", "--model", "small-moe", "--train", "ep4,pp2", "--infer", "tp2,engines2"]) == 0
    out = capsys.readouterr().out
    assert "imbalance (max / mean sender)" in out and "for_rank(4)" in out and "small-moe" in out
    assert main(["plan", "--model", "tiny-dense", "--json", "--rank", "1"]) == 0
    assert '"ranks"' in capsys.readouterr().out
    assert main(["plan", "--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["plan", "--train", "tp3"]) == 2  # 2 KV heads cannot be split 3 ways
    assert main(["frobnicate"]) == 2
    assert main([]) == 2 and "plan" in capsys.readouterr().out
