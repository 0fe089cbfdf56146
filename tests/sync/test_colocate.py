"""Colocated CPU weight sync between two real processes through POSIX shared memory, on a
~250 MB float32 model, checked bit-exactly against an oracle both processes compute.

Checks: every update lands bit-exactly; handles are published once and reused while no storage
pointer changes (and re-published when one does); releasing the training weights really frees
RAM (the process's RSS drops by at least 80% of the released bytes) and resuming brings them back
bit-identically; released inference weights refuse generation until the next update lands.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import zlib

import torch
import torch.nn as nn
from _dist import run_world

from awex_fast.meta import ParameterMeta, ShardMeta
from awex_fast.net import KVStoreServer
from awex_fast.sync import InferenceAdapter, KVWorker, TrainingAdapter, WeightSyncPair, serve_kv_worker

KEY = "colocate-test-key"
CHANNEL = "colocate"
HIDDEN, INTER, VOCAB, LAYERS = 1024, 4096, 12288, 4  # 62.9M float32 parameters: 252 MB

SHAPES = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
for _i in range(LAYERS):
    SHAPES |= {f"model.layers.{_i}.mlp.gate_proj.weight": (INTER, HIDDEN),
               f"model.layers.{_i}.mlp.up_proj.weight": (INTER, HIDDEN),
               f"model.layers.{_i}.mlp.down_proj.weight": (HIDDEN, INTER)}
TOTAL_BYTES = sum(torch.Size(s).numel() for s in SHAPES.values()) * 4
_BASE: dict[str, torch.Tensor] = {}


def base(name: str) -> torch.Tensor:
    if name not in _BASE:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        _BASE[name] = torch.randn(SHAPES[name], generator=gen)
    return _BASE[name]


def oracle(name: str, version: int) -> torch.Tensor:
    return base(name) * (version + 1)  # exact in float32 for these small factors


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()


class ColocatedTrainer(TrainingAdapter):
    """Writes the oracle of ``version`` in place before each update (an optimizer step); at
    version 5 it rebinds one parameter to new memory, as a load_state_dict(assign=True) would."""

    version = 0

    def execute_colocate_weight_update(self, version):
        params = dict(self.source.named_parameters())
        with torch.no_grad():
            if version == 5:
                params["model.layers.0.mlp.up_proj.weight"].data = torch.empty(
                    SHAPES["model.layers.0.mlp.up_proj.weight"]
                )
            for name, p in params.items():
                torch.mul(base(name), version + 1, out=p.data)
        self.version = version
        return super().execute_colocate_weight_update(version)

    def resume_memory(self, tags=None):
        out = super().resume_memory(tags)
        params = self.source.named_parameters()
        out["bit_identical"] = all(torch.equal(p, oracle(n, self.version)) for n, p in params)
        return out


def _train_worker(rank, world_size, kv_url):
    with torch.device("meta"):
        model = Model()
    model.to_empty(device="cpu")
    adapter = ColocatedTrainer(model, rank=0, world_size=1, admin_api_key=KEY, timeout_s=60)
    return {"commands": serve_kv_worker(adapter, kv_url, CHANNEL, "train0", admin_api_key=KEY)}


class ColocatedEngine(InferenceAdapter):
    def execute_colocate_weight_update(self, version):
        out = super().execute_colocate_weight_update(version)
        views = self.get_local_shard_parameters()
        out["bad"] = [n for n, v in views.items() if not torch.equal(v, oracle(n, version))]
        out["ready"] = self.weights_ready
        return out

    def release_memory(self, tags=None):
        return {**super().release_memory(tags), "ready": self.weights_ready}

    def resume_memory(self, tags=None):
        return {**super().resume_memory(tags), "ready": self.weights_ready}


def _infer_worker(rank, world_size, kv_url):
    views, metas = {}, []
    views["model.embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN)
    for i in range(LAYERS):
        gate_up = torch.zeros(2 * INTER, HIDDEN)  # vLLM's fused gate_up_proj, canonical views into it
        views[f"model.layers.{i}.mlp.gate_proj.weight"] = gate_up[:INTER]
        views[f"model.layers.{i}.mlp.up_proj.weight"] = gate_up[INTER:]
        views[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTER)
    for name, v in views.items():
        metas.append(ParameterMeta(name, SHAPES[name], "float32", (ShardMeta(0, (0, 0), tuple(v.shape)),)))
    adapter = ColocatedEngine(lambda: views, metas=metas, admin_api_key=KEY, timeout_s=60)
    return {"commands": serve_kv_worker(adapter, kv_url, CHANNEL, "infer0", admin_api_key=KEY)}


def test_colocated_cpu_shared_memory_handles_release_and_resume():
    server = KVStoreServer(admin_api_key=KEY).start()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    futures = [pool.submit(run_world, _train_worker, 1, server.url, backend=None, timeout=300),
               pool.submit(run_world, _infer_worker, 1, server.url, backend=None, timeout=300)]
    train, infer = KVWorker(server.url, CHANNEL, "train0", KEY), KVWorker(server.url, CHANNEL, "infer0", KEY)
    pair = WeightSyncPair("colo", server.url, [train], [[infer]], admin_api_key=KEY, colocate=True,
                          timeout_s=120)
    try:
        pair.connect()
        t_label, i_label = (f"training rank 0 ({train.label})", f"engine 0 rank 0 ({infer.label})")

        def update(version):
            r = pair.update_weights(version)
            assert r["status"] == "ok", r
            assert r["workers"][i_label]["bad"] == [] and r["workers"][i_label]["ready"], r
            return r["workers"][t_label], r["workers"][i_label]

        for version in (1, 2, 3):
            t, i = update(version)
            assert t["republished"] == (version == 1) and t["epoch"] == 1
            assert i["maps_opened"] == 1 and i["bytes"] == TOTAL_BYTES  # one segment, mapped once

        released = pair.release_memory("training", ["weights"])[0]
        assert released["released"]["weights"] >= TOTAL_BYTES
        drop = released["rss_before"] - released["rss_after"]
        assert drop >= 0.8 * released["released"]["weights"], released
        assert pair.resume_memory("training", ["weights"])[0]["bit_identical"]

        t, i = update(4)  # released and resumed in place: the handles still hold
        assert not t["republished"] and i["maps_opened"] == 1
        t, i = update(5)  # one parameter moved to new memory: republished, remapped
        assert t["republished"] and t["epoch"] == 2 and i["maps_opened"] > 1
        t, _ = update(6)
        assert not t["republished"]

        gone = pair.release_memory("inference", ["weights"])[0]
        assert not gone["ready"] and gone["rss_before"] - gone["rss_after"] >= 0.8 * TOTAL_BYTES, gone
        assert not pair.resume_memory("inference", ["weights"])[0]["ready"]  # contents were not kept
        update(7)  # lands in the resumed memory; ready again
        assert pair.disconnect()["errors"] == []
    finally:
        pair.close()
        for w in (train, infer):
            with contextlib.suppress(Exception):  # already gone
                w.stop(timeout=30)
        results = [f.result(timeout=60) for f in futures]
        pool.shutdown()
        server.stop()
    assert all(r[0]["commands"] > 0 for r in results)
