"""The child processes of `awex-fast bench --engine vllm` (`awex_fast.bench.vllm`): the FSDP2 trainer
ranks that drive every route into the vLLM server, and the stand-in receivers of the raw bound;
``python -m awex_fast.bench.vllm_ranks trainer|raw SPEC.json`` (JSON spec in, JSON result file out).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# routes that are awex_fast joined once more with other options
_EXTRA_AWEX: dict[str, dict[str, Any]] = {
    "awex_fast_receiver": {"fp8_quantize": "engine"},  # the workers quantize to FP8
    "awex_fast_blocking": {"receive_while_serving": False},  # vLLM stands still for the receive
}


def _post(url: str, route: str, body: dict, timeout: float) -> Any:
    import requests

    r = requests.post(url + route, json=body, timeout=timeout)
    r.raise_for_status()
    return r.json() if r.content else None


def _use_backend(url: str, name: str, timeout: float) -> None:
    _post(url, "/collective_rpc", {"method": "awex_fast_use_backend", "args": [name]}, timeout)


def _checksums(url: str, timeout: float) -> dict[str, str]:
    return _post(url, "/weight_checker", {"action": "checksum"}, timeout)["checksums"]


class _Parent:
    """The parent's TCPStore: barriers between the trainer ranks and the raw receivers, and the
    per-pair byte counts the raw bound replays."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(host, port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        self.n: dict[str, int] = {}

    def barrier(self, name: str, world: int) -> None:
        """Meet ``world`` processes at the next barrier of series ``name``."""
        self.n[name] = self.n.get(name, 0) + 1
        key = f"barrier/{name}/{self.n[name]}"
        self.store.add(key, 1)
        while self.store.add(key, 0) < world:
            time.sleep(0.0005)


def _raw_runner(parent: _Parent, spec: dict, transfer_rank: int, pair_bytes: dict[int, int] | None,
                role: str) -> tuple[Any, Any, int]:
    """Join the raw group (receivers are transfer ranks 0..tp-1, trainer ranks follow) and build
    `awex_fast.bench.worker._raw` over the pairs of awex_fast's plan."""
    import torch

    from awex_fast.bench.worker import _raw
    from awex_fast.transport import init_transfer_group_on_free_port

    tp, world = spec["tp"], spec["tp"] + spec["trainers"]
    if role == "send":
        assert pair_bytes is not None
        parent.store.set(f"raw/pairs/{transfer_rank}", json.dumps(pair_bytes))
        buckets = [SimpleNamespace(peer=p, payload=n) for p, n in pair_bytes.items()]
        rp = SimpleNamespace(sends=buckets, recvs=[])
    else:
        recvs = []
        for t in range(tp, world):
            parent.store.wait([f"raw/pairs/{t}"])
            pairs = json.loads(parent.store.get(f"raw/pairs/{t}"))
            if str(transfer_rank) in pairs:
                recvs.append(SimpleNamespace(peer=t, payload=int(pairs[str(transfer_rank)])))
        rp = SimpleNamespace(sends=[], recvs=recvs)
    def await_port() -> int:
        parent.store.wait(["raw/port"])
        return int(parent.store.get("raw/port"))

    group, _ = init_transfer_group_on_free_port(
        # receiver 0 binds the rendezvous: on the engine host's address where there are two hosts
        spec.get("transport", "gloo"), transfer_rank, world, spec["engine_host"],
        lambda port: parent.store.set("raw/port", str(port)), await_port, spec["timeout"], "awex_fast_raw")
    run, nbytes, refresh = _raw(group, rp, torch.device("cpu"))
    return run, refresh, nbytes


def raw_main(spec: dict) -> None:
    """A stand-in receiver of the raw bound (transfer rank ``spec['rank']``)."""
    parent = _Parent(spec["store_host"], spec["store_port"], spec["timeout"])
    run, _, nbytes = _raw_runner(parent, spec, spec["rank"], None, "recv")
    world = spec["tp"] + spec["trainers"]
    times = []
    for it in range(spec["iters"] + 1):
        parent.barrier("raw", world)
        t0 = time.perf_counter()
        run()
        if it > 0:
            times.append(time.perf_counter() - t0)
    parent.barrier("raw-done", world)
    Path(spec["result"]).write_text(json.dumps({"times": times, "bytes": nbytes}))


def _sum_over_ranks(value: int) -> int:
    """``value`` summed over the trainer ranks (the default process group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _link_tx_bytes(device: str | None) -> int | None:
    """Bytes this host has sent out of ``device`` so far (its kernel counter; None: no device)."""
    if device is None:
        return None
    return int(Path(f"/sys/class/net/{device}/statistics/tx_bytes").read_text())


def _pair_bytes(engine: Any) -> dict[int, int]:
    """Bytes awex_fast's plan sends from this trainer rank to each worker (transfer rank)."""
    return engine.adapter.executor.send_bytes_by_peer()


class _TrainerRank:
    """One FSDP2 trainer rank of the vLLM bench: its model, its routes into the server (awex_fast,
    vLLM's NCCL-style broadcast baseline, a safetensors checkpoint + reload, the raw bound)."""

    def __init__(self, spec: dict) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource

        self.spec = spec
        self.rank, self.world = spec["rank"], spec["trainers"]
        self.url, self.timeout = spec["url"], spec["timeout"]
        self.methods = spec["methods"]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["dist_port"]))
        dist.init_process_group("gloo", rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=self.timeout))
        self.parent = _Parent(spec["store_host"], spec["store_port"], self.timeout)
        config = AutoConfig.from_pretrained(spec["ckpt"])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        self.locals = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        self.source = ModuleSource(model)
        self.inf_dtype = getattr(torch, spec["dtype"])
        self.model_bytes = sum(p.numel() for p in model.parameters()) * self.inf_dtype.itemsize
        self.client = HTTPVLLMWeightSyncClient(self.url)
        self.disk_dir = Path(spec["disk_dir"])
        self._init_routes()

    def _init_routes(self) -> None:
        """Join every route the spec asks for (the server's backend is switched per route)."""
        import torch.distributed as dist
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from awex_fast.vllm import AwexFastTrainerInitInfo
        from awex_fast.vllm.baselines import BACKEND_NAME as BROADCAST
        from awex_fast.vllm.baselines import BroadcastTrainerInitInfo

        spec = self.spec
        self.awex = WeightTransferTrainerFactory.trainer_init(
            AwexFastTrainerInitInfo(rank=self.rank, world_size=self.world,
                                    transport=spec.get("transport", "gloo")),
            client=self.client, source=self.source)
        # more awex_fast engines on the workers (one per route, `BenchWorkerExtension` tags)
        self.extra: dict[str, Any] = {}
        for route, options in _EXTRA_AWEX.items():
            if route in self.methods:
                self.switch(route)
                self.extra[route] = WeightTransferTrainerFactory.trainer_init(
                    AwexFastTrainerInitInfo(rank=self.rank, world_size=self.world,
                                            transport=spec.get("transport", "gloo"), **options),
                    client=self.client, source=self.source)
                self.switch("awex_fast")
        self.bcast = None
        if "broadcast" in self.methods:
            if self.rank == 0:
                _use_backend(self.url, BROADCAST, self.timeout)
            self.bcast = WeightTransferTrainerFactory.trainer_init(
                BroadcastTrainerInitInfo(rank=self.rank, num_workers=spec["tp"], dtype=spec["dtype"],
                                         master_address=spec["trainer_host"],
                                         buffer_size_bytes=spec["buffer_mb"] << 20, timeout_s=self.timeout),
                client=self.client, source=self.source)
            if self.rank == 0:
                _use_backend(self.url, "awex_fast", self.timeout)
        dist.barrier()
        self.raw = None
        if "raw" in self.methods:
            self.raw = _raw_runner(self.parent, spec, spec["tp"] + self.rank, _pair_bytes(self.awex), "send")

    def rewrite(self) -> None:
        """New weights for the next round (negated in place: every byte changes)."""
        import torch

        with torch.no_grad():
            for t in self.locals:
                t.neg_()

    def run_disk(self) -> dict[str, float]:
        """Gather the full model, save it as safetensors (rank 0), and have vLLM reload it."""
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        full = {}
        for name, tensor in self.source:  # the gathers: a collective on every rank
            if self.rank == 0:
                full[name] = tensor.to(self.inf_dtype)
        if self.rank != 0:
            return {}
        disk_file = self.disk_dir / "model.safetensors"
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        disk_file.unlink(missing_ok=True)
        save_file(full, str(disk_file), metadata={"format": "pt"})
        del full
        t1 = time.perf_counter()
        _post(self.url, "/collective_rpc",
              {"method": "reload_weights", "kwargs": {"weights_path": str(self.disk_dir)}}, self.timeout)
        t2 = time.perf_counter()
        return {"total": t2 - t0, "save": t1 - t0, "reload": t2 - t1, "finalize": None}

    def run(self, method: str) -> dict[str, float | None]:
        """One round through ``method``, with its phases."""
        t0 = time.perf_counter()
        if method == "disk":
            return self.run_disk()
        engines = {"awex_fast": self.awex, "broadcast": self.bcast, **self.extra}
        engine = engines.get(method)
        if engine is None:
            raise ValueError(f"unknown or uninitialized method {method!r}")
        # vLLM's own engine runs its layerwise reload from start to finish: generating in between
        # would read half-loaded layers, so (as vLLM's RL examples do) generation pauses around it
        hold = method == "broadcast" and bool(self.spec.get("stall")) and self.rank == 0
        if hold:
            _post(self.url, "/pause?mode=keep", {}, self.timeout)
        try:
            engine.send_weights()
        finally:
            if hold:
                _post(self.url, "/resume", {}, self.timeout)
        lr = engine.last_round
        out = {"start": lr.get("start_s"), "update_rpc": lr.get("update_s"), "finalize": lr.get("finish_s")}
        if lr.get("receive_s") is not None:  # received while vLLM served; update is the apply
            out["receive"] = lr["receive_s"]
        if method.startswith("awex_fast"):
            out["send"] = lr.get("send_s")
            out["wire_bytes"] = _sum_over_ranks(int(lr.get("bytes_sent", 0)))
        total = time.perf_counter() - t0
        fin = out.get("finalize")
        return {**out, "total": total, "transfer": total - fin if fin is not None else total}

    def switch(self, method: str) -> None:
        """Point the server at the backend ``method`` uses (rank 0 asks, over HTTP)."""
        from awex_fast.vllm.baselines import BACKEND_NAME as BROADCAST

        backend = {"awex_fast": "awex_fast", "broadcast": BROADCAST,
                   **{r: "awex_fast#" + r.removeprefix("awex_fast_") for r in _EXTRA_AWEX}}.get(method)
        if self.rank == 0 and backend is not None:
            _use_backend(self.url, backend, self.timeout)

    def timed_rounds(self) -> dict[str, list[dict]]:
        """``iters`` + 1 rounds of every method, interleaved; the first round is warm-up."""
        from awex_fast.bench.stall import TokenStream, stall_s

        spec, rank = self.spec, self.rank
        times: dict[str, list[dict]] = {m: [] for m in self.methods if m != "raw"}
        windows: list[tuple[dict, tuple[float, float]]] = []  # (its record, the update's window)
        stream = TokenStream(self.url) if rank == 0 and spec.get("stall") else contextlib.nullcontext()
        with stream:
            self._timed_loop(times, windows)
        if isinstance(stream, TokenStream):  # a streaming request ran through every update
            if stream.error is not None:
                raise RuntimeError(f"the streaming request failed: {stream.error}") from stream.error
            every = [w for _, w in windows]
            for record, window in windows:
                record["stall"] = stall_s(stream.gaps, window, every)
        return times

    def _timed_loop(self, times: dict[str, list[dict]], windows: list) -> None:
        import torch.distributed as dist

        spec, rank = self.spec, self.rank
        for it in range(spec["iters"] + 1):
            for method in self.methods:
                if method == "raw":
                    assert self.raw is not None
                    self.raw[1]()  # rewrite the send buffers
                    self.parent.barrier("raw", spec["tp"] + self.world)
                    self.raw[0]()
                    continue
                self.switch(method)
                self.rewrite()
                sent0 = _link_tx_bytes(spec["link_device"]) if rank == 0 else None
                dist.barrier()
                begin = time.perf_counter()
                got = self.run(method)
                window = (begin, time.perf_counter())
                dist.barrier()
                if sent0 is not None:  # everything the trainer host put on the link, HTTP included
                    got["link_bytes"] = _link_tx_bytes(spec["link_device"]) - sent0
                if rank == 0 and method != "disk":  # each worker's own phases (untimed RPC)
                    workers = _post(self.url, "/collective_rpc", {"method": "awex_fast_last_timings"},
                                    self.timeout)
                    for w, t in enumerate(workers.get("results", []) if workers else []):
                        got.update({f"worker{w}_{k}": v for k, v in (t or {}).items()})
                if it > 0 and rank == 0:
                    times[method].append(got)
                    windows.append((got, window))
                if rank == 0:
                    print(f"iter {it} {method}: {json.dumps(got)}", flush=True)
        if self.raw is not None:
            self.parent.barrier("raw-done", spec["tp"] + self.world)

    def verify(self) -> dict[str, list[str]]:
        """The same weights through every route, the server's checksums after each; returns, per
        route, the parameters whose checksums differ from awex_fast's (rank 0; empty elsewhere)."""
        import torch.distributed as dist

        sums: dict[str, dict[str, str]] = {}
        for method in [m for m in self.methods if m != "raw"] + ["awex_fast"]:
            self.switch(method)
            dist.barrier()
            self.run(method)
            dist.barrier()
            if self.rank == 0:
                got = _checksums(self.url, self.timeout)
                if method in sums and sums[method] != got:
                    sums[method + "_again"] = got
                sums.setdefault(method, got)
        mismatches: dict[str, list[str]] = {}
        if self.rank == 0:
            ref = sums["awex_fast"]
            for m, s in sums.items():
                bad = sorted(k for k in ref.keys() | s.keys() if ref.get(k) != s.get(k))
                if bad:
                    mismatches[m] = bad[:8] + ([f"... {len(bad)} in all"] if len(bad) > 8 else [])
        return mismatches

    def shutdown(self) -> None:
        """Close every route (each on its own backend) and leave the server on awex_fast."""
        import torch.distributed as dist

        from awex_fast.vllm.baselines import BACKEND_NAME as BROADCAST

        for route, engine in self.extra.items():
            self.switch(route)
            engine.shutdown()
        self.switch("awex_fast")
        self.awex.shutdown()
        if self.bcast is not None:
            if self.rank == 0:
                _use_backend(self.url, BROADCAST, self.timeout)
            self.bcast.shutdown()
        dist.barrier()


def trainer_main(spec: dict) -> None:
    """One FSDP2 trainer rank: init every route, time them interleaved, verify, report (rank 0)."""
    import torch.distributed as dist

    trainer = _TrainerRank(spec)
    times = trainer.timed_rounds()
    mismatches = trainer.verify()
    trainer.shutdown()
    if trainer.rank == 0:
        Path(spec["result"]).write_text(json.dumps({
            "times": times, "model_bytes": trainer.model_bytes, "checksums_equal": not mismatches,
            "mismatches": mismatches}))
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    """``python -m awex_fast.bench.vllm_ranks trainer|raw SPEC.json`` (spawned by `bench_vllm_main`)."""
    if len(argv) != 2 or argv[0] not in ("trainer", "raw"):
        print("usage: python -m awex_fast.bench.vllm_ranks trainer|raw SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    (trainer_main if argv[0] == "trainer" else raw_main)(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
