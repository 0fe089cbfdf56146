"""Adapters in one process: the two protocols, the KV metadata format and rank shifts, an
in-process pair over real gloo groups (engines of unequal sizes), memory release semantics, and
the worker routes' authentication on a real HTTP server."""

from __future__ import annotations

import inspect
import json
import typing
import urllib.error
import urllib.request

import pytest
import torch
import torch.nn as nn

from awex_fast.meta import MetadataError, ParameterMeta, ShardMeta, ShardRule
from awex_fast.net import BackgroundServer, KVStoreServer
from awex_fast.sync import (
    INFER_META_KEY,
    AwexInferenceAdapter,
    AwexTrainingAdapter,
    InferenceAdapter,
    PairError,
    TrainingAdapter,
    WeightsNotReadyError,
    WeightSyncPair,
    assemble_world,
    check_own_pieces,
    decode_side_metas,
    encode_side_metas,
)
from awex_fast.sync.routes import ROUTES, worker_app

KEY = "adapter-test-key"
MEMBERS = {"parallelism_strategy", "get_weight_metadata", "get_local_shard_parameters",
           "init_weight_update_group", "execute_weight_update", "batch_isend_irecv",
           "teardown_weight_update_group", "init_colocate_weight_update", "execute_colocate_weight_update",
           "release_memory", "resume_memory"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))


def test_protocols_have_exactly_the_seed_members_and_arguments():
    for proto in (AwexTrainingAdapter, AwexInferenceAdapter):
        bases = [c for c in proto.__mro__ if c not in (typing.Protocol, typing.Generic, object)]
        members = {n for c in bases for n in vars(c) if not n.startswith("_")}
        assert members == MEMBERS, proto
        assert isinstance(inspect.getattr_static(proto, "parallelism_strategy"), property)
        init = list(inspect.signature(proto.init_weight_update_group).parameters)[1:]
        assert init == ["pair_name", "master_addr", "master_port", "transfer_rank", "world_size",
                        "kv_store_url", "infer_world_size", "train_world_size", "num_engines"]
        colo = inspect.signature(proto.init_colocate_weight_update).parameters
        assert list(colo)[1:] == ["pair_name", "kv_store_url", "transfer_rank", "infer_world_size",
                    "train_world_size", "num_engines", "master_port", "admin_api_key", "timeout_s"]
        assert colo["admin_api_key"].default == "areal-admin-key" and colo["timeout_s"].default == 120.0
        assert list(inspect.signature(proto.get_local_shard_parameters).parameters)[1:] == ["required_names"]
        assert list(inspect.signature(proto.release_memory).parameters)[1:] == ["tags"]


def test_adapters_satisfy_the_protocols_and_others_do_not():
    tr = TrainingAdapter(_model(), admin_api_key=KEY)
    inf = InferenceAdapter(lambda: {"w": torch.zeros(3)}, admin_api_key=KEY)
    assert isinstance(tr, AwexTrainingAdapter) and isinstance(inf, AwexInferenceAdapter)
    assert isinstance(inf, AwexTrainingAdapter)  # same members: the side is a runtime role

    class Partial:
        parallelism_strategy = {}

        def get_weight_metadata(self):
            return []

    assert not isinstance(Partial(), AwexTrainingAdapter) and not isinstance(_model(), AwexInferenceAdapter)
    assert tr.parallelism_strategy == {"world_size": 1, "tp_size": 1, "pp_size": 1, "dp_size": 1,
                                       "ep_size": 1, "rank": 0}


def test_name_map_renames_and_skips_and_local_tensors_share_memory():
    model = _model()
    tr = TrainingAdapter(model, name_map=lambda n: None if n.endswith("bias") else f"model.{n}")
    metas = tr.get_weight_metadata()
    assert [m.name for m in metas] == ["model.0.weight", "model.2.weight"]
    assert metas[0].shards == (ShardMeta(0, (0, 0), (10, 6)),)
    local = tr.get_local_shard_parameters(["model.2.weight"])
    assert local["model.2.weight"].data_ptr() == model[2].weight.data_ptr()
    with pytest.raises(KeyError, match=r"model\.9\.weight"):
        tr.get_local_shard_parameters(["model.9.weight"])


def _meta(name, shape, rank, offset, piece):
    return ParameterMeta(name, shape, "float32", (ShardMeta(rank, offset, piece),))


def test_side_metadata_round_trips_and_engines_shift_by_prefix_sums():
    # engine 0 has 2 ranks, engine 1 has 1; training has 2 ranks: transfer ranks 0,1 | 2 | 3,4
    e0 = [_meta("w", (4, 2), 0, (0, 0), (2, 2)), _meta("w", (4, 2), 1, (2, 0), (2, 2))]
    e1 = [_meta("w", (4, 2), 0, (0, 0), (4, 2))]
    train = [ParameterMeta("w", (4, 2), "float32", rules=(ShardRule((0, 1), (0,), (2,)),))]
    infer_v = encode_side_metas("inference", [e0, e1], [2, 1])
    train_v = encode_side_metas("training", [train], [2], bucket_bytes=4096)
    json.dumps(infer_v)  # plain JSON, base64 inside
    assert decode_side_metas(infer_v, "inference")[0] == [2, 1] and train_v["bucket_bytes"] == 4096
    t, i = assemble_world(train_v, infer_v, infer_world_size=3, train_world_size=2, num_engines=2)
    assert sorted(p.rank for p in i[0].pieces()) == [0, 1, 2]
    assert i[0].pieces_for_rank(2)[0].shape == (4, 2)
    assert t[0].rules[0].ranks == (3, 4)
    with pytest.raises(MetadataError, match="num_engines=3"):
        assemble_world(train_v, infer_v, infer_world_size=3, train_world_size=2, num_engines=3)
    with pytest.raises(MetadataError, match="names rank 1"):  # a rank outside its engine
        decode_side_metas(encode_side_metas("inference", [e0], [1]), "inference")
    with pytest.raises(MetadataError, match="side='inference'"):
        decode_side_metas(infer_v, "training")
    check_own_pieces(i, [_meta("w", (4, 2), 2, (0, 0), (4, 2))], 2)
    with pytest.raises(MetadataError, match="parameter 'w'"):
        check_own_pieces(i, [_meta("w", (4, 2), 1, (0, 0), (2, 2))], 1)


def _engine(tp, rank, released=None):
    """Replicated bias, row-split weight of the (10, 6) first layer, in bfloat16."""
    rows = 10 // tp
    views = {"0.weight": torch.zeros(rows, 6, dtype=torch.bfloat16),
             "0.bias": torch.zeros(10, dtype=torch.bfloat16)}
    metas = [ParameterMeta("0.weight", (10, 6), "bfloat16", (ShardMeta(rank, (rank * rows, 0), (rows, 6)),)),
             ParameterMeta("0.bias", (10,), "bfloat16", (ShardMeta(rank, (0,), (10,)),))]
    hooks = None
    if released is not None:
        hooks = {"kv_cache": (lambda: released.append("free"), lambda: released.append("back"))}
    return InferenceAdapter(lambda: views, metas=metas, rank=rank, engine_size=tp, admin_api_key=KEY,
                            timeout_s=20, release_hooks=hooks), views


def _landed(model, views, rank, tp):
    rows = 10 // tp
    w = model[0].weight.detach()[rank * rows : (rank + 1) * rows].to(torch.bfloat16)
    return torch.equal(views["0.weight"], w) and torch.equal(views["0.bias"],
                       model[0].bias.detach().to(torch.bfloat16))


def test_in_process_pair_with_unequal_engines_and_inference_memory_release():
    model = _model()
    tr = TrainingAdapter(model, name_map=lambda n: n if n.startswith("0.") else None, admin_api_key=KEY,
                         timeout_s=20, bucket_bytes=64)
    hooked: list[str] = []
    e0 = [_engine(1, 0, hooked)]
    e1 = [_engine(2, 0), _engine(2, 1)]
    with KVStoreServer(admin_api_key=KEY) as kv:
        # the engines were built with the default bucket size: the pair's published one rules
        pair = WeightSyncPair("inproc", kv.url, [tr], [[a for a, _ in e0], [a for a, _ in e1]],
                              admin_api_key=KEY, timeout_s=20, bucket_bytes=64)
        try:
            info = pair.connect()
            assert list(info["transfer_ranks"].values()) == [0, 1, 2, 3]
            for version in (1, 2):
                with torch.no_grad():
                    model[0].weight.mul_(-1.5)
                result = pair.update_weights(version)
                assert result["status"] == "ok", result
                assert _landed(model, e0[0][1], 0, 1)
                assert all(_landed(model, v, r, 2) for r, (_, v) in enumerate(e1))
                assert [a.version for a, _ in (*e0, *e1)] == [version] * 3
            adapter = e0[0][0]
            out = adapter.release_memory()  # every tag: the engine's kv_cache hook and its weights
            assert out["released"] == {"kv_cache": None, "weights": 60 * 2 + 10 * 2} and hooked == ["free"]
            with pytest.raises(WeightsNotReadyError, match="released"):
                adapter.require_weights()
            assert adapter.release_memory(["weights"])["skipped"] == ["weights"]
            adapter.resume_memory()
            assert hooked == ["free", "back"] and not adapter.weights_ready  # contents were not kept
            with pytest.raises(ValueError, match="'optimizer'"):
                adapter.release_memory(["optimizer"])
            assert pair.update_weights(3)["status"] == "ok" and adapter.weights_ready
            assert _landed(model, e0[0][1], 0, 1)
            assert kv.store.get("inproc", INFER_META_KEY)["sizes"] == [1, 2]
            pair.disconnect()
        finally:
            pair.close()


def test_pair_refuses_workers_in_the_wrong_order():
    a0, _ = _engine(2, 0)
    a1, _ = _engine(2, 1)
    tr = TrainingAdapter(_model(), name_map=lambda n: n if n.startswith("0.") else None, admin_api_key=KEY)
    with KVStoreServer(admin_api_key=KEY) as kv:
        pair = WeightSyncPair("swapped", kv.url, [tr], [[a1, a0]], admin_api_key=KEY, timeout_s=10)
        try:
            with pytest.raises(PairError, match="reports rank 1 but sits at position 0"):
                pair.connect()
            failed = pair.update_weights(1)
            assert failed["status"] == "failed" and "not connected" in failed["error"]
        finally:
            pair.close()


def test_training_optimizer_state_release_resume_is_bit_identical(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    before = {k: v.clone() for s in opt.state.values() for k, v in s.items()}
    weights = [p.detach().clone() for p in model.parameters()]
    tr = TrainingAdapter(model, optimizer=opt, offload_dir=str(tmp_path))
    out = tr.release_memory()
    assert set(out["released"]) == {"optimizer", "weights"} and len(list(tmp_path.iterdir())) > 0
    assert all(s["exp_avg"].untyped_storage().nbytes() == 0 for s in opt.state.values())
    tr.resume_memory()
    after = {k: v for s in opt.state.values() for k, v in s.items()}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert list(tmp_path.iterdir()) == []


def _call(url, route, body=None, key=None, method="POST"):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/awex/{route}", data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_worker_routes_need_the_key_except_the_reports():
    tr = TrainingAdapter(_model(), admin_api_key=KEY)
    with BackgroundServer(worker_app(tr)) as srv:
        mutating = [r for r, (needs, _) in ROUTES.items() if needs]
        assert len(mutating) == 8
        for route in mutating:
            assert _call(srv.url, route, {"version": 1})[0] == 401, route
            assert _call(srv.url, route, {"version": 1}, key="wrong")[0] == 403, route
        status, answer = _call(srv.url, "report_parallelism", method="GET")
        assert status == 200 and answer["result"]["world_size"] == 1
        status, answer = _call(srv.url, "report_weight_meta", {})
        assert status == 200 and "metas" in answer["result"]
        status, answer = _call(srv.url, "update_weights", {"version": "one"}, key=KEY)
        assert status == 400 and "'version'" in answer["error"]
        status, answer = _call(srv.url, "init_weights_update_group", {"pair_name": "p"}, key=KEY)
        assert status == 400 and "missing field" in answer["error"]
        status, answer = _call(srv.url, "update_weights", {"version": 1}, key=KEY)  # no group yet
        assert (
            status == 500
            and answer["type"] == "RuntimeError"
            and "init_weight_update_group" in answer["error"]
        )
        status, answer = _call(srv.url, "release_memory", {"tags": ["weights"]}, key=KEY)
        assert status == 200 and answer["result"]["released"]["weights"] > 0
        assert _call(srv.url, "resume_memory", {}, key=KEY)[0] == 200


def test_in_process_colocated_many_to_many_through_shared_tensors():
    """Two training ranks (dim-0 chunks of w, b replicated; callables over share_tensors) and one
    TP=2 engine splitting w by columns: every inference rank reads from both training ranks, and
    every training rank waits for two acks."""
    from awex_fast.meta import chunk_bounds
    from awex_fast.sync import share_tensors

    gen = torch.Generator().manual_seed(3)
    full = {"w": torch.randn(9, 6, generator=gen), "b": torch.randn(5, generator=gen)}
    trainers, keep = [], []
    for r in range(2):
        lo, hi = chunk_bounds(9, 2, r)
        seg, shared = share_tensors({"w": full["w"][lo:hi], "b": full["b"]})
        keep.append(seg)
        metas = [ParameterMeta("w", (9, 6), "float32", (ShardMeta(r, (lo, 0), (hi - lo, 6)),)),
                 ParameterMeta("b", (5,), "float32", (ShardMeta(r, (0,), (5,)),))]
        trainers.append((TrainingAdapter(lambda s=shared: s, metas=metas, rank=r, world_size=2,
                                         admin_api_key=KEY), shared))
    engines = []
    for r in range(2):
        views = {"w": torch.zeros(9, 3, dtype=torch.bfloat16), "b": torch.zeros(5, dtype=torch.bfloat16)}
        metas = [ParameterMeta("w", (9, 6), "bfloat16", (ShardMeta(r, (0, 3 * r), (9, 3)),)),
                 ParameterMeta("b", (5,), "bfloat16", (ShardMeta(r, (0,), (5,)),))]
        engines.append((InferenceAdapter(lambda v=views: v, metas=metas, rank=r, engine_size=2,
                                         admin_api_key=KEY), views))
    with KVStoreServer(admin_api_key=KEY) as kv:
        pair = WeightSyncPair("colo2", kv.url, [a for a, _ in trainers], [[a for a, _ in engines]],
                              admin_api_key=KEY, colocate=True, timeout_s=20)
        try:
            info = pair.connect()
            assert all(r["peers"] == [0, 1] for k, r in info["init"].items() if k.startswith("training"))
            for version in (1, 2):
                result = pair.update_weights(version)
                assert result["status"] == "ok", result
                for r, (_, views) in enumerate(engines):
                    assert torch.equal(views["w"], full["w"][:, 3 * r : 3 * r + 3].to(torch.bfloat16))
                    assert torch.equal(views["b"], full["b"].to(torch.bfloat16))
                published = [v for k, v in result["workers"].items() if k.startswith("training")]
                assert [p["republished"] for p in published] == [version == 1] * 2
                with torch.no_grad():  # an optimizer step in place: same storage, same handles
                    full["w"].mul_(-2)
                    full["b"].add_(1)
                    for (_, shared), r in zip(trainers, (0, 1), strict=True):
                        lo, hi = chunk_bounds(9, 2, r)
                        shared["w"].copy_(full["w"][lo:hi])
                        shared["b"].copy_(full["b"])
            pair.disconnect()
        finally:
            pair.close()
