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
import contextlib
import datetime
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from awex_fast.net import ADMIN_KEY_ENV
from python_engines.inference.config import ServerConfig
from python_engines.inference.loop import EngineLoop, UpdateFailed
from python_engines.inference.worker import Worker

__all__ = ["ADMIN_KEY_ENV", "EngineLoop", "ServerConfig", "ServerHandle", "UpdateFailed", "launch_server"]

logger = logging.getLogger(__name__)

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
