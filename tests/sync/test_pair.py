"""WeightSyncPair end to end over real processes, checked bit-exactly against an oracle that every
process computes independently (same seed per parameter and version).

* One FSDP2 dp=2 training job (its own gloo world, non-HF parameter names through ``name_map``)
  and two inference engines (TP=1, and TP=2 with its own gloo world) in vLLM's fused layout
  (q|k|v and gate|up in one tensor per rank, canonical views into them, bfloat16), wired only
  through the KV store server and a `WeightSyncPair` whose workers are `KVWorker` channels.
* The same processes driven over HTTP: their ``/awex/*`` routes, through the ``awex-fast
  gateway`` app.
* A training worker killed: the failed update is reported with the error; after a replacement
  joins, the next update re-forms the group on a fresh port and lands bit-exactly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.request
import zlib

import pytest
import torch
import torch.nn as nn
from _dist import WorldError, run_world

from awex_fast.meta import ParameterMeta, ShardMeta, chunk_bounds
from awex_fast.net import BackgroundServer, KVStoreClient, KVStoreServer
from awex_fast.sync import (
    INFER_META_KEY,
    TRAINING_META_KEY,
    InferenceAdapter,
    KVWorker,
    TrainingAdapter,
    WeightSyncPair,
    digest_key,
    gateway_app,
    serve_kv_worker,
    worker_app,
)

KEY = "pair-test-key"
CHANNEL = "jobs"
HIDDEN, Q_ROWS, KV_ROWS, INTER, VOCAB, LAYERS = 32, 32, 16, 48, 65, 2  # 65: uneven vocab chunks

SHAPES: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
for _i in range(LAYERS):
    _p = f"model.layers.{_i}."
    SHAPES |= {_p + "self_attn.q_proj.weight": (Q_ROWS, HIDDEN),
               _p + "self_attn.k_proj.weight": (KV_ROWS, HIDDEN),
               _p + "self_attn.v_proj.weight": (KV_ROWS, HIDDEN),
               _p + "self_attn.o_proj.weight": (HIDDEN, Q_ROWS), _p + "mlp.gate_proj.weight": (INTER, HIDDEN),
               _p + "mlp.up_proj.weight": (INTER, HIDDEN), _p + "mlp.down_proj.weight": (HIDDEN, INTER),
               _p + "input_layernorm.weight": (HIDDEN,)}
SHAPES |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}

# the trainer's own names -> canonical names ("scratch" is training-only and skipped)
_SHORT = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "ln": "input_layernorm",
}


def hf_name(raw: str) -> str | None:
    parts = raw.split(".")
    if parts[0] == "blocks":
        if parts[2] == "scratch":
            return None
        return f"model.layers.{parts[1]}.{_SHORT[parts[2]]}.weight"
    return {"emb": "model.embed_tokens.weight", "norm": "model.norm.weight",
            "head": "lm_head.weight"}[parts[0]]


def oracle(name: str, version: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + version)
    return torch.randn(SHAPES[name], generator=gen)


def box(offset, shape):
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for short, canon in _SHORT.items():
            self.register_parameter(short,
                                    nn.Parameter(torch.zeros(SHAPES[f"model.layers.0.{canon}.weight"])))
        self.scratch = nn.Parameter(torch.zeros(3))


class TinyTrainModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.zeros(VOCAB, HIDDEN))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.Parameter(torch.zeros(HIDDEN))
        self.head = nn.Parameter(torch.zeros(VOCAB, HIDDEN))


class Trainer(TrainingAdapter):
    """Writes the oracle of ``version`` into its local pieces in place (an optimizer step) before
    every send, as an RL step would."""

    def set_weights(self, version: int) -> None:
        with torch.no_grad():
            local = self.get_local_shard_parameters()
            for meta in self.get_weight_metadata():
                full = oracle(meta.name, version)
                for p in meta.pieces():
                    local[meta.name][box(p.local, p.shape)].copy_(full[box(p.global_offset, p.shape)])

    def execute_weight_update(self, version):
        self.set_weights(version)
        return super().execute_weight_update(version)


def engine_layout(tp: int, rank: int) -> tuple[dict[str, torch.Tensor], list[ParameterMeta]]:
    """vLLM-style TP rank ``rank`` of ``tp``: fused qkv / gate_up tensors, canonical views into
    them, vocab-parallel embedding and head, row-parallel o/down, replicated norms (bfloat16)."""
    views, metas = {}, []

    def piece(name: str, view: torch.Tensor, offset: tuple[int, ...]) -> None:
        views[name] = view
        metas.append(
            ParameterMeta(name, SHAPES[name], "bfloat16", (ShardMeta(rank, offset, tuple(view.shape)),))
        )

    bf = torch.bfloat16
    lo, hi = chunk_bounds(VOCAB, tp, rank)
    piece("model.embed_tokens.weight", torch.zeros(hi - lo, HIDDEN, dtype=bf), (lo, 0))
    piece("lm_head.weight", torch.zeros(hi - lo, HIDDEN, dtype=bf), (lo, 0))
    piece("model.norm.weight", torch.zeros(HIDDEN, dtype=bf), (0,))
    q, kv, inter = Q_ROWS // tp, KV_ROWS // tp, INTER // tp
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        qkv = torch.zeros(q + 2 * kv, HIDDEN, dtype=bf)  # one fused tensor, as the engine holds it
        piece(p + "self_attn.q_proj.weight", qkv[:q], (rank * q, 0))
        piece(p + "self_attn.k_proj.weight", qkv[q : q + kv], (rank * kv, 0))
        piece(p + "self_attn.v_proj.weight", qkv[q + kv :], (rank * kv, 0))
        piece(p + "self_attn.o_proj.weight", torch.zeros(HIDDEN, q, dtype=bf), (0, rank * q))
        gate_up = torch.zeros(2 * inter, HIDDEN, dtype=bf)
        piece(p + "mlp.gate_proj.weight", gate_up[:inter], (rank * inter, 0))
        piece(p + "mlp.up_proj.weight", gate_up[inter:], (rank * inter, 0))
        piece(p + "mlp.down_proj.weight", torch.zeros(HIDDEN, inter, dtype=bf), (0, rank * inter))
        piece(p + "input_layernorm.weight", torch.zeros(HIDDEN, dtype=bf), (0,))
    return views, metas


class Engine(InferenceAdapter):
    """Checks every piece against the oracle (cast to bfloat16) after each landed update."""

    def execute_weight_update(self, version):
        out = super().execute_weight_update(version)
        views = self.get_local_shard_parameters()
        bad = [
            m.name
            for m in self.get_weight_metadata()
            for p in m.pieces()
            if not torch.equal(
                views[m.name], oracle(m.name, version)[box(p.global_offset, p.shape)].to(torch.bfloat16)
            )
        ]
        return {**out, "bad": bad}


def _serve(adapter, kv_url: str, worker_id: str) -> dict:
    """Serve ``adapter`` over HTTP and over the KV store until a KVWorker says stop."""
    server = BackgroundServer(worker_app(adapter)).start()
    with KVStoreClient(kv_url, KEY) as kv:
        kv.put(CHANNEL, f"url_{worker_id}", {"url": server.url, "pid": os.getpid()})
    try:
        commands = serve_kv_worker(adapter, kv_url, CHANNEL, worker_id, admin_api_key=KEY, poll_s=0.05)
    finally:
        server.stop()
        adapter.teardown_weight_update_group()
    return {"commands": commands}


def _fsdp_train_job(rank, world_size, kv_url):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = TinyTrainModel()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    adapter = Trainer(model, name_map=hf_name, admin_api_key=KEY, timeout_s=30, bucket_bytes=2048)
    adapter.set_weights(0)
    return _serve(adapter, kv_url, f"train{rank}")


def _engine_job(rank, world_size, kv_url, engine):
    views, metas = engine_layout(world_size, rank)
    adapter = Engine(lambda: views, metas=metas, rank=rank, engine_size=world_size, admin_api_key=KEY,
                     timeout_s=30, bucket_bytes=2048)
    return _serve(adapter, kv_url, f"engine{engine}_{rank}")


def _plain_train_job(rank, world_size, kv_url, train_rank, n_train, worker_id, timeout_s):
    """A training rank over plain tensors: dim-0 chunk ``train_rank`` of ``n_train`` (no
    default process group; it can be killed and replaced alone)."""
    tensors, metas = {}, []
    for name, shape in SHAPES.items():
        lo, hi = chunk_bounds(shape[0], n_train, train_rank)
        if hi > lo:
            tensors[name] = torch.zeros((hi - lo, *shape[1:]))
            metas.append(
                ParameterMeta(
                    name,
                    shape,
                    "float32",
                    (ShardMeta(train_rank, (lo,) + (0,) * (len(shape) - 1), tensors[name].shape),),
                )
            )
    adapter = Trainer(lambda: tensors, metas=metas, rank=train_rank, world_size=n_train, admin_api_key=KEY,
                      timeout_s=timeout_s, bucket_bytes=4096)
    return _serve(adapter, kv_url, worker_id)


def wait_published(kv: KVStoreClient, ids, futures, timeout: float = 240.0) -> dict[str, dict]:
    """Every worker's {"url", "pid"}; fails at once if a job died while starting."""
    deadline, found = time.monotonic() + timeout, {}
    while len(found) < len(ids):
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        for i in ids:
            if i not in found:
                with contextlib.suppress(KeyError):  # not published yet
                    found[i] = kv.get(CHANNEL, f"url_{i}")
        assert time.monotonic() < deadline, f"workers never published: {sorted(set(ids) - set(found))}"
        time.sleep(0.2)
    return found


IDS = ["engine0_0", "engine1_0", "engine1_1", "train0", "train1"]


@pytest.fixture(scope="module")
def jobs():
    server = KVStoreServer(admin_api_key=KEY).start()
    pool = concurrent.futures.ThreadPoolExecutor(3)
    futures = [
        pool.submit(run_world, _fsdp_train_job, 2, server.url, timeout=300),  # its own gloo world
        pool.submit(run_world, _engine_job, 1, server.url, 0, backend=None, timeout=300),
        pool.submit(run_world, _engine_job, 2, server.url, 1, timeout=300),  # its own gloo world
    ]
    kv = KVStoreClient(server.url, KEY)
    workers = {i: KVWorker(server.url, CHANNEL, i, KEY, poll_s=0.02) for i in IDS}
    try:
        published = wait_published(kv, IDS, futures)
        yield {"url": server.url, "kv": kv, "workers": workers, "published": published}
    finally:
        for w in workers.values():
            with contextlib.suppress(Exception):  # already gone
                w.stop(timeout=20)
        results = [f.result(timeout=60) for f in futures]
        kv.close()
        pool.shutdown()
        server.stop()
    assert all(r["commands"] > 0 for job in results for r in job)


def test_kv_wired_pair_fsdp2_to_tp1_and_tp2_engines_three_updates_bit_exact(jobs):
    w = jobs["workers"]
    pair = WeightSyncPair("kvpair", jobs["url"], [w["train0"], w["train1"]],
                          [[w["engine0_0"]], [w["engine1_0"], w["engine1_1"]]], admin_api_key=KEY,
                          timeout_s=30)
    try:
        info = pair.connect()
        assert list(info["transfer_ranks"].values()) == [0, 1, 2, 3, 4]  # engines first, training after
        assert info["peers"][f"engine 1 rank 1 ({w['engine1_1'].label})"] == [3, 4]
        kv = jobs["kv"]
        infer_meta = kv.get("kvpair", INFER_META_KEY)
        assert infer_meta["sizes"] == [1, 2] and kv.get("kvpair", TRAINING_META_KEY)["sizes"] == [2]
        assert {kv.get("kvpair", digest_key(r)) for r in range(5)} == {info["digest"]}
        for version in (1, 2, 3):
            result = pair.update_weights(version)
            assert result["status"] == "ok" and result["error"] is None, result
            assert result["version"] == version and result["duration_ms"] > 0 and not result["reformed"]
            engines = {k: v for k, v in result["workers"].items() if k.startswith("engine")}
            assert len(engines) == 3 and all(v["bad"] == [] for v in engines.values()), engines
            assert all(v["bytes_received"] > 0 for v in engines.values())
        assert pair.disconnect()["errors"] == []
    finally:
        pair.close()


def _post(url: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_same_pair_over_http_workers_through_the_gateway(jobs):
    urls = {i: jobs["published"][i]["url"] for i in IDS}
    with BackgroundServer(gateway_app(KEY, serve_kv=False)) as gw:
        assert _post(gw.url + "/connect", {"pair_name": "x"}, key=None)[0] == 401
        status, answer = _post(
            gw.url + "/connect",
            {
                "pair_name": "httppair",
                "kv_store_url": jobs["url"],
                "timeout_s": 30,
                "training": [urls["train0"], urls["train1"]],
                "engines": [[urls["engine0_0"]], [urls["engine1_0"], urls["engine1_1"]]],
            },
        )
        assert status == 200, answer
        for version in (4, 5, 6):
            status, result = _post(gw.url + "/update_weights", {"pair_name": "httppair", "version": version})
            assert status == 200 and result["status"] == "ok", result
            engines = {k: v for k, v in result["workers"].items() if k.startswith("engine")}
            assert len(engines) == 3 and all(v["bad"] == [] for v in engines.values()), engines
        with urllib.request.urlopen(gw.url + "/health", timeout=10) as resp:
            assert json.loads(resp.read())["pairs"] == ["httppair"]
        assert _post(gw.url + "/disconnect", {"pair_name": "httppair"})[0] == 200
        assert _post(gw.url + "/update_weights", {"pair_name": "httppair", "version": 7})[0] == 404


def test_killed_training_worker_is_reported_and_a_replacement_reforms_the_group():
    server = KVStoreServer(admin_api_key=KEY).start()
    kv = KVStoreClient(server.url, KEY)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    timeout_s = 8.0
    train = [
        pool.submit(
            run_world, _plain_train_job, 1, server.url, r, 2, f"t{r}", timeout_s, backend=None, timeout=240
        )
        for r in (0, 1)
    ]
    engine = pool.submit(run_world, _engine_job, 1, server.url, 9, backend=None, timeout=240)
    ids = ["t0", "t1", "engine9_0"]
    live = {i: KVWorker(server.url, CHANNEL, i, KEY) for i in ids}
    pair, killed = None, None
    try:
        pub = wait_published(kv, ids, [*train, engine])
        # the workers were built with different bucket sizes: the published one rules
        pair = WeightSyncPair("failpair", server.url, [pub["t0"]["url"], pub["t1"]["url"]],
                              [[pub["engine9_0"]["url"]]], admin_api_key=KEY, timeout_s=timeout_s,
                              bucket_bytes=1024)
        pair.connect()
        assert pair.update_weights(1)["status"] == "ok"
        port_before = kv.get("failpair", "transfer_master_port")["port"]

        os.kill(pub["t1"]["pid"], signal.SIGKILL)
        killed = "t1"
        with pytest.raises(WorldError):
            train[1].result(timeout=60)
        t0 = time.monotonic()
        failed = pair.update_weights(2)
        assert failed["status"] == "failed" and failed["version"] == 2
        assert "training rank 1" in failed["error"] and "TransferError" in failed["error"], failed["error"]
        assert time.monotonic() - t0 < 4 * timeout_s + 10

        replacement = pool.submit(run_world, _plain_train_job, 1, server.url, 1, 2, "t1b", timeout_s,
                                  backend=None, timeout=240)
        live["t1b"] = KVWorker(server.url, CHANNEL, "t1b", KEY)
        new = wait_published(kv, ["t1b"], [replacement])["t1b"]
        pair.replace_worker("training", 1, new["url"])
        recovered = pair.update_weights(3)
        assert recovered["status"] == "ok" and recovered["reformed"], recovered
        assert recovered["workers"][f"engine 0 rank 0 ({pub['engine9_0']['url']})"]["bad"] == []
        assert kv.get("failpair", "transfer_master_port")["port"] != port_before  # a fresh port
        assert pair.update_weights(4)["status"] == "ok" and not pair.update_weights(5)["reformed"]
        pair.disconnect()
    finally:
        if pair is not None:
            pair.close()
        for i, w in live.items():
            if i != killed:
                with contextlib.suppress(Exception):  # already gone
                    w.stop(timeout=20)
        pool.shutdown(wait=True)
        kv.close()
        server.stop()


def test_gateway_cli_refuses_bad_arguments(monkeypatch, capsys):
    from awex_fast.sync import gateway_main

    monkeypatch.delenv("AWEX_FAST_ADMIN_KEY", raising=False)
    assert gateway_main([]) == 2 and "no admin key" in capsys.readouterr().err
    assert gateway_main(["--admin-key", "k", "--port", "70000"]) == 2
    with KVStoreServer(admin_api_key=KEY) as kv:  # a port already taken
        assert gateway_main(["--admin-key", "k", "--port", str(kv.port)]) == 1
        assert "cannot listen" in capsys.readouterr().err
