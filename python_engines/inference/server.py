"""The inference server: ``tp_size`` worker processes, HTTP on TP rank 0.

Why processes started fresh (``python -m python_engines.inference.server --worker <json>``) and
not forked or spawned with pickled state: nothing crosses a process boundary as pickle in this
project, and a fresh interpreter per rank is what a real deployment runs. The parent passes one
JSON config on the command line (the admin key travels in the environment, never in argv).

Startup: rank 0 binds a TCPStore on port 0 and writes its port to ``<run_dir>/store_port``; the
other ranks read it and everybody joins the engine's process group (gloo on CPU, nccl on GPU).
Each rank builds its shard of the model (`python_engines.inference.worker.Worker`). Rank 0 then
listens on HTTP (port 0: the OS picks) and writes ``<run_dir>/ready.json`` with its URL; a rank
that fails writes ``<run_dir>/error<rank>.txt``. `launch_server` waits for one or the other.

Threads on rank 0: the main thread runs the engine loop (`EngineLoop`): it drains control
commands, then runs one `Scheduler.step`, and so on, so every weight update, pause and version
change happens at a step boundary. The aiohttp server runs on a private loop thread and hands
commands to the engine loop (`EngineLoop.call`), awaiting their results. Routes and JSON bodies:
``docs/http.md`` (`python_engines.inference.routes`).

Update semantics: an update (disk or awex) runs between two steps: decoding is paused for
exactly its duration, the version is bumped (to the update's version, else +1), every running
sequence's KV cache is recomputed with the new weights, and decoding resumes: later tokens carry
the new version. A failed update marks the weights invalid: in-flight requests end with an error,
``/generate`` answers 503 until a later update succeeds, and the weights are never served
half-updated.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import logging
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from awex_fast.net import ADMIN_KEY_ENV
from python_engines.inference.scheduler import Scheduler
from python_engines.inference.worker import Worker

__all__ = ["ADMIN_KEY_ENV", "EngineLoop", "ServerConfig", "ServerHandle", "UpdateFailed", "launch_server"]

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """Everything a worker process needs, as JSON. ``model_path``: an HF directory (weights
    loaded from it); else ``hf_config`` (a config.json dict) with random weights from ``seed``
    (normal with ``initializer_range``, default the config's, else 0.02)."""

    model_path: str | None = None
    hf_config: dict[str, Any] | None = None
    tp_size: int = 1
    backend: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "float32"
    max_seq_len: int = 1024
    max_running: int = 32
    seed: int = 0
    initializer_range: float | None = None
    num_threads: int = 1
    version: int = 0
    group_timeout_s: float = 600.0
    heartbeat_s: float = 5.0
    transfer_backend: str | None = None
    transfer_timeout_s: float = 120.0
    bucket_bytes: int = 256 << 20
    gang_timeout_s: float = 60.0
    run_dir: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.model_path is None) == (self.hf_config is None):
            raise ValueError("ServerConfig needs exactly one of model_path and hf_config")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"ServerConfig.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"ServerConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.tp_size < 1 or self.max_running < 1 or self.max_seq_len < 2:
            raise ValueError(f"ServerConfig: tp_size ({self.tp_size}), max_running ({self.max_running}) "
                             f"must be >= 1 and max_seq_len ({self.max_seq_len}) >= 2")

    def read_hf_config(self) -> dict[str, Any]:
        """The model's config.json as a dict."""
        if self.hf_config is not None:
            return dict(self.hf_config)
        return json.loads((Path(str(self.model_path)) / "config.json").read_text())


class UpdateFailed(RuntimeError):
    """A weight update failed on some rank; the server now refuses generation."""


class EngineLoop:
    """Rank 0's scheduler loop; control commands run on it between steps (see module docstring)."""

    def __init__(self, worker: Worker, config: ServerConfig) -> None:
        """Wrap ``worker`` with a scheduler sized by ``config``."""
        self.worker = worker
        self.config = config
        self.scheduler = Scheduler(worker.forward, config.max_running, config.max_seq_len,
                                   worker.cache.scratch_slot, config.max_running, config.seed, worker.device)
        self.version = config.version
        self.weights_error: str | None = None
        self.kv_released = False
        self.last_update: dict[str, Any] | None = None
        self.updates = 0
        #: The weight-sync group every rank holds (``/health`` reports it): ``{"kind": "transfer"
        #: or "colocate", "pair_name", "transfer_ranks", "failed"}``, None when no rank holds one.
        self.weight_sync: dict[str, Any] | None = None
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._stop = False

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine loop at the next step boundary; thread-safe."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return fut

    def stop(self) -> None:
        """Ask the loop to exit after the current step (called on the loop)."""
        self._stop = True

    def run(self) -> None:
        """Loop until `stop`; then tell the other ranks to shut down."""
        last_collective = time.monotonic()
        while not self._stop:
            idle = not self.scheduler.has_work()
            try:
                wait = self.config.heartbeat_s if idle else None
                item = self._commands.get(timeout=wait) if idle else self._commands.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the HTTP handler
                        fut.set_exception(exc)
                last_collective = time.monotonic()
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = None
            if self._stop:
                break
            if self.scheduler.has_work():
                self.scheduler.step(self.version)
                last_collective = time.monotonic()
            elif time.monotonic() - last_collective >= self.config.heartbeat_s:
                self.worker.run_collective({"op": "noop"})
                last_collective = time.monotonic()
        self.worker.broadcast_op({"op": "shutdown"})

    # ------------------------------------------------------------------------------ updates

    def run_update(self, header: dict[str, Any], version: int | None, what: str) -> dict[str, Any]:
        """Run a collective weight-update op (on the loop): the whole pause-to-resume window."""
        start = time.perf_counter()
        results = self.worker.run_collective(header)
        errors = [r["error"] for r in results if not r["ok"]]
        if errors:
            self.mark_weights_invalid(f"{what} failed: {'; '.join(errors)}")
            raise UpdateFailed(self.weights_error)
        return self.landed(version, start, what, results)

    def landed(self, version: int | None, start: float, what: str,
               results: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Record a successful update: valid weights, new version, fresh KV for running requests."""
        self.weights_error = None
        self.version = self.version + 1 if version is None else int(version)
        self.scheduler.invalidate_cache()
        self.updates += 1
        took = time.perf_counter() - start
        self.last_update = {"what": what, "version": self.version, "pause_to_resume_ms": took * 1e3}
        return {"success": True, "version": self.version, "duration_ms": took * 1e3,
                "results": results or []}

    def refusal(self) -> str | None:
        """Why generation is refused right now (None: it is not)."""
        if self.weights_error is not None:
            return self.weights_error
        if self.kv_released:
            return "the KV cache is released (release_memory); call resume_memory first"
        return None

    def run_adapter(self, method: str, calls: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
        """Run one awex adapter call per rank as a single op (on the loop; `python_engines.
        inference.sync`). Updates bump the version or mark the weights invalid; releases
        interrupt running requests first, since their KV cache or weights go away."""
        start = time.perf_counter()
        header = {"op": "adapter", "calls": calls}
        kwargs = next(c for c in calls if c is not None).get("kwargs") or {}
        if method == "release_memory":
            self.scheduler.interrupt_all()
        results = self.worker.run_collective(header)
        errors = [r["error"] for r in results if not r["ok"]]
        if method in ("execute_weight_update", "execute_colocate_weight_update"):
            version = int(kwargs["version"])
            if errors:
                why = "; ".join(errors)
                self.mark_weights_invalid(f"awex weight update to version {version} failed: {why}")
            else:
                self.landed(version, start, f"awex {method}")
        if method in ("init_weight_update_group", "init_colocate_weight_update"):
            self.weight_sync = None if errors else {
                "kind": "transfer" if method == "init_weight_update_group" else "colocate",
                "pair_name": kwargs.get("pair_name"), "failed": False,
                "transfer_ranks": [int(r["value"]["transfer_rank"]) for r in results]}
        elif method == "teardown_weight_update_group":
            self.weight_sync = None
        elif errors and self.weight_sync is not None and method.startswith("execute_"):
            self.weight_sync = {**self.weight_sync, "failed": True}
        if method in ("release_memory", "resume_memory") and not errors:
            tags = kwargs.get("tags")
            if tags is None or "kv_cache" in tags:
                self.kv_released = method == "release_memory"
            if method == "release_memory" and (tags is None or "weights" in tags):
                self.mark_weights_invalid("weights were released (release_memory); waiting for an update")
        return results

    def mark_weights_invalid(self, error: str) -> None:
        """Refuse generation until the next successful update; in-flight requests end with ``error``."""
        self.weights_error = error
        self.scheduler.fail_all(error)

    def metrics(self) -> dict[str, Any]:
        """The ``/metrics`` answer (on the loop)."""
        return {**self.scheduler.metrics(), "version": self.version,
                "weights_valid": self.weights_error is None, "weights_error": self.weights_error,
                "kv_cache_released": self.kv_released, "weight_sync": self.weight_sync,
                "tp_size": self.worker.tp_size,
                "updates": self.updates, "last_update": self.last_update}


# ---------------------------------------------------------------------------------------- workers


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _join_group(config: ServerConfig, rank: int) -> None:
    run_dir = Path(config.run_dir)
    timeout = datetime.timedelta(seconds=config.group_timeout_s)
    port_file = run_dir / "store_port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, config.tp_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        _write_atomic(port_file, str(store.port))
    else:
        deadline = time.monotonic() + config.group_timeout_s
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: rank 0 published no store port in {port_file}")
            time.sleep(0.02)
        store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), config.tp_size, is_master=False,
                              timeout=timeout)
    if config.backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(config.backend, store=store, rank=rank, world_size=config.tp_size,
                            timeout=timeout)


def worker_main(config: ServerConfig, rank: int) -> None:
    """Body of one worker process: join the group, build the shard, serve (rank 0) or follow."""
    torch.set_num_threads(config.num_threads)
    _join_group(config, rank)
    worker = Worker(asdict(config), config.read_hf_config())
    if rank != 0:
        worker.follow()
        return
    from awex_fast.net import BackgroundServer
    from python_engines.inference.routes import build_app

    engine = EngineLoop(worker, config)
    admin_key = os.environ.get(ADMIN_KEY_ENV) or ""
    server = BackgroundServer(lambda: build_app(engine, admin_key), config.host, config.port,
                              name="awex-fast-inference")
    server.start()
    try:
        ready = json.dumps({"url": server.url, "pid": os.getpid()})
        _write_atomic(Path(config.run_dir) / "ready.json", ready)
        engine.run()
    finally:
        server.stop()


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit this worker when the process that launched it is gone (the handle can no longer
    shut it down): a daemon thread polls the parent pid."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.warning("launching process %d is gone; worker exits", parent)
        os._exit(3)

    threading.Thread(target=watch, name="awex-fast-parent-watch", daemon=True).start()


def _worker_entry(config_json: str, rank: int) -> int:
    config = ServerConfig(**json.loads(config_json))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    _exit_with_parent()
    try:
        worker_main(config, rank)
    except BaseException:
        import traceback

        _write_atomic(Path(config.run_dir) / f"error{rank}.txt", traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------- launcher


class ServerHandle:
    """A running server: ``url`` (the real port), ``admin_api_key``, ``shutdown()``."""

    def __init__(self, url: str, admin_api_key: str, procs: list[subprocess.Popen], run_dir: Path,
                 owns_run_dir: tempfile.TemporaryDirectory | None) -> None:
        """Wrap started processes; use `launch_server` instead of calling this."""
        self.url = url
        self.admin_api_key = admin_api_key
        self.procs = procs
        self.run_dir = run_dir
        self._owned = owns_run_dir

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, in TP rank order."""
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        """True while every worker process runs."""
        return all(p.poll() is None for p in self.procs)

    def logs(self, limit: int = 4000) -> str:
        """The tail of every worker's log."""
        out = []
        for rank in range(len(self.procs)):
            path = self.run_dir / f"log{rank}.txt"
            with contextlib.suppress(OSError):
                out.append(f"--- rank {rank} ---\n{path.read_text(errors='replace')[-limit:]}")
        return "\n".join(out)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the workers: SIGTERM, then SIGKILL after ``timeout`` seconds (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self._owned is not None:
            self._owned.cleanup()
            self._owned = None

    def __enter__(self) -> ServerHandle:
        """``with launch_server(...) as server:``."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Shut the server down."""
        self.shutdown()


def _wait_ready(handle: ServerHandle, timeout: float) -> None:
    """Wait for rank 0's ready file; raise with the failing rank's traceback or on timeout."""
    run_dir, procs = handle.run_dir, handle.procs
    deadline = time.monotonic() + timeout
    while not (run_dir / "ready.json").exists():
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        if dead or any(run_dir.glob("error*.txt")):
            time.sleep(0.2)  # let the error file land
            errors = sorted(run_dir.glob("error*.txt"))
            detail = "\n".join(e.read_text(errors="replace")[-3000:] for e in errors)
            raise RuntimeError(f"inference server failed to start (ranks exited: {dead}):\n"
                               f"{detail or handle.logs()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"inference server not ready after {timeout:.0f} s:\n{handle.logs()}")
        time.sleep(0.05)


def _as_config_source(model_path_or_config: Any) -> dict[str, Any]:
    if isinstance(model_path_or_config, (str, os.PathLike)):
        return {"model_path": str(model_path_or_config)}
    if isinstance(model_path_or_config, dict):
        return {"hf_config": dict(model_path_or_config)}
    if hasattr(model_path_or_config, "to_dict"):
        return {"hf_config": model_path_or_config.to_dict()}
    raise TypeError(f"model_path_or_config must be a path, a config dict or a PretrainedConfig, got "
                    f"{type(model_path_or_config).__name__}")


def launch_server(
    model_path_or_config: Any,
    tp_size: int = 1,
    host: str = "127.0.0.1",
    port: int = 0,
    backend: str | None = None,
    *,
    admin_api_key: str | None = None,
    setup_timeout: float = 120.0,
    env: dict[str, str] | None = None,
    **options: Any,
) -> ServerHandle:
    """Start ``tp_size`` worker processes serving one model over HTTP; return once it answers.

    ``model_path_or_config``: an HF checkpoint directory, or a config (dict or
    ``PretrainedConfig``) for random weights. ``backend`` None picks nccl when CUDA is available,
    else gloo. ``admin_api_key`` (default ``$AWEX_FAST_ADMIN_KEY``, else a fresh random key,
    readable as ``handle.admin_api_key``) guards the mutating routes. ``options`` are further
    `ServerConfig` fields (``dtype``, ``max_seq_len``, ``max_running``, ``seed``, ...).
    Raises RuntimeError with the failing rank's traceback, or TimeoutError after ``setup_timeout``.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    key = admin_api_key or os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(24)
    owned = tempfile.TemporaryDirectory(prefix="awex_infer_")
    run_dir = Path(owned.name)
    config = ServerConfig(**_as_config_source(model_path_or_config), tp_size=tp_size, backend=backend,
                          host=host, port=port, run_dir=str(run_dir), **options)
    worker_env = {**os.environ, ADMIN_KEY_ENV: key, "PYTHONUNBUFFERED": "1"}
    worker_env.setdefault("OMP_NUM_THREADS", str(config.num_threads))
    if sys.platform.startswith("linux"):
        worker_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    worker_env.update(env or {})
    payload = json.dumps(asdict(config))
    procs: list[subprocess.Popen] = []
    handle = ServerHandle("", key, procs, run_dir, owned)
    try:
        for rank in range(tp_size):
            with (run_dir / f"log{rank}.txt").open("wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "python_engines.inference.server", "--worker", payload,
                     "--rank", str(rank)],
                    # cwd=run_dir: `-m` puts the cwd first on sys.path, and a source checkout
                    # there (no compiled extension) must not shadow the installed package.
                    stdout=log, stderr=subprocess.STDOUT, env=worker_env, start_new_session=True,
                    cwd=run_dir))
        _wait_ready(handle, setup_timeout)
        handle.url = json.loads((run_dir / "ready.json").read_text())["url"]
    except BaseException:
        handle.shutdown(timeout=2.0)
        raise
    return handle


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--worker <json> --rank r`` (internal), or launch a server and serve until Ctrl-C."""
    parser = argparse.ArgumentParser(description="awex_fast tensor-parallel inference server")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", help="HF checkpoint directory")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    args = parser.parse_args(argv)
    if args.worker is not None:
        return _worker_entry(args.worker, args.rank)
    if not args.model:
        parser.error("--model is required")
    handle = launch_server(args.model, args.tp, args.host, args.port, dtype=args.dtype)
    print(json.dumps({"url": handle.url}), flush=True)
    try:
        while handle.alive():
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        handle.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
