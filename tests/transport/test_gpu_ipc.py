"""Colocated CUDA IPC between two processes on one GPU, for a 7B-shaped bfloat16 model
(Qwen2.5-7B's tensor list from awex_fast.layouts.models, ~15 GB): every update bit-exact, handles mapped
once and reused, time per update against one device-to-device copy of the same bytes (target: at
most 1.5x), and release/resume of the training weights through pinned host memory.

Writes the measured figures to ``$OUT/gpu_ipc.json`` when ``OUT`` is set (scripts/gpu_check.sh).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import statistics
import time
import zlib
from pathlib import Path

import pytest
import torch
from _dist import run_world

import awex_fast._native as _native
from awex_fast.layouts import model_spec
from awex_fast.meta import ParameterMeta, ShardMeta
from awex_fast.net import KVStoreServer
from awex_fast.sync import InferenceAdapter, KVWorker, TrainingAdapter, WeightSyncPair, serve_kv_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not _native.build_info()["cuda"], reason="awex_fast built without CUDA"),
]

KEY = "gpu-ipc-key"
CHANNEL = "gpu_ipc"
MODEL = os.environ.get("AWEX_FAST_IPC_MODEL", "qwen2.5-7b")
UPDATES = 5  # the first maps every handle; the rest are timed


def _specs() -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in model_spec(MODEL).tensors}


def _fill(t: torch.Tensor, name: str, version: int) -> None:
    gen = torch.Generator(device=t.device).manual_seed(zlib.crc32(name.encode()) * 1000 + version)
    t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32))


def _tensors(zero: bool) -> tuple[dict[str, torch.Tensor], list[ParameterMeta]]:
    tensors = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in _specs().items()}
    metas = [ParameterMeta(n, s, "bfloat16", (ShardMeta(0, (0,) * len(s), s),)) for n, s in _specs().items()]
    if not zero:
        for n, t in tensors.items():
            _fill(t, n, 0)
    return tensors, metas


class GpuTrainer(TrainingAdapter):
    def execute_colocate_weight_update(self, version):
        for name, t in self.get_local_shard_parameters().items():
            _fill(t, name, version)
        return super().execute_colocate_weight_update(version)


def _train_worker(rank, world_size, kv_url):
    tensors, metas = _tensors(zero=False)
    adapter = GpuTrainer(lambda: tensors, metas=metas, rank=0, world_size=1, admin_api_key=KEY, timeout_s=300)
    return {"commands": serve_kv_worker(adapter, kv_url, CHANNEL, "train0", admin_api_key=KEY)}


def _d2d_seconds(nbytes: int, samples: int = 5) -> float:
    """Median time of one device-to-device copy of ``nbytes`` (first sample dropped)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(samples + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return statistics.median(times[1:])


class GpuEngine(InferenceAdapter):
    def init_colocate_weight_update(self, *args, **kwargs):
        out = super().init_colocate_weight_update(*args, **kwargs)
        nbytes = sum(t.numel() * t.element_size() for t in self.get_local_shard_parameters().values())
        return {**out, "bytes": nbytes, "d2d_seconds": _d2d_seconds(nbytes)}

    def execute_colocate_weight_update(self, version):
        out = super().execute_colocate_weight_update(version)
        bad = []
        for name, t in self.get_local_shard_parameters().items():
            expected = torch.empty_like(t)
            _fill(expected, name, version)
            if not torch.equal(t, expected):
                bad.append(name)
        return {**out, "bad": bad}


def _infer_worker(rank, world_size, kv_url):
    tensors, metas = _tensors(zero=True)
    adapter = GpuEngine(lambda: tensors, metas=metas, admin_api_key=KEY, timeout_s=300)
    return {"commands": serve_kv_worker(adapter, kv_url, CHANNEL, "infer0", admin_api_key=KEY)}


def test_cuda_ipc_colocated_7b_update_close_to_one_device_copy():
    server = KVStoreServer(admin_api_key=KEY).start()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    futures = [pool.submit(run_world, f, 1, server.url, backend=None, timeout=900)
               for f in (_train_worker, _infer_worker)]
    train, infer = KVWorker(server.url, CHANNEL, "train0", KEY), KVWorker(server.url, CHANNEL, "infer0", KEY)
    pair = WeightSyncPair("gpu", server.url, [train], [[infer]], admin_api_key=KEY, colocate=True,
                          timeout_s=600)
    figures: dict = {"model": MODEL, "device": torch.cuda.get_device_name()}
    try:
        t_label, i_label = f"training rank 0 ({train.label})", f"engine 0 rank 0 ({infer.label})"
        init = pair.connect()["init"][i_label]
        figures.update(bytes=init["bytes"], d2d_seconds=init["d2d_seconds"])
        copies, totals, ends = [], [], []
        for version in range(1, UPDATES + 1):
            r = pair.update_weights(version)
            assert r["status"] == "ok", r
            i, t = r["workers"][i_label], r["workers"][t_label]
            assert i["bad"] == [], i["bad"][:5]
            assert t["republished"] == (version == 1)
            copies.append(i["copy_seconds"])
            totals.append(i["seconds"])
            ends.append(r["duration_ms"] / 1e3)
        figures.update(maps_opened=i["maps_opened"], copy_seconds=copies, infer_seconds=totals,
                       pair_seconds=ends)
        ratio = statistics.median(copies[1:]) / init["d2d_seconds"]
        figures["copy_over_d2d"] = ratio

        released = pair.release_memory("training", ["weights"])[0]
        figures["released_bytes"] = released["released"]["weights"]
        figures["cuda_allocated"] = [released["cuda_allocated_before"], released["cuda_allocated"]]
        freed = released["cuda_allocated_before"] - released["cuda_allocated"]
        assert freed >= 0.8 * figures["released_bytes"], figures
        resumed = pair.resume_memory("training", ["weights"])[0]
        r = pair.update_weights(UPDATES + 1)  # resumed storage moved: republished and remapped
        assert r["status"] == "ok" and r["workers"][i_label]["bad"] == [], r
        assert r["workers"][t_label]["republished"]
        figures["after_resume"] = {"resumed": resumed["resumed"],
                                   "copy_seconds": r["workers"][i_label]["copy_seconds"]}
        assert ratio <= 1.5, figures
        assert i["maps_opened"] >= 1
        pair.disconnect()
    finally:
        pair.close()
        for w in (train, infer):
            with contextlib.suppress(Exception):  # already gone
                w.stop(timeout=60)
        for f in futures:
            f.result(timeout=120)
        pool.shutdown()
        server.stop()
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_ipc.json").write_text(json.dumps(figures, indent=1))
