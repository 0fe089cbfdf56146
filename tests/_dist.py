"""Run a function in a world of real processes (one per rank) for multi-process tests.

Why subprocesses and not ``torch.multiprocessing.spawn``: spawn pickles the function and its
arguments, and this project sends nothing across processes as pickle. Here each worker is a fresh
``python tests/_dist.py <spec.json>`` that imports the test module *by file path*, looks the
function up by name, and receives its arguments as JSON; its return value comes back as JSON.

Rendezvous: rank 0 creates the ``TCPStore`` on port 0 (the OS picks a free port and rank 0 keeps
it bound, so two worlds never race for one port) and publishes the port in a file of the world's
temporary directory; the other ranks wait for that file and join ``torch.distributed`` through
the store. The parent never imports torch. A worker that raises writes its traceback to a file; the parent
then kills the rest of the world at once (they would hang in a collective) and raises
`WorldError` with that traceback. A world that runs past ``timeout`` first has every worker dump
its threads' stacks (SIGUSR1, faulthandler), then is killed and raises `WorldTimeout` with those
stacks. Workers run with one intra-op thread, since CI machines are small and shared.

Usage::

    def _worker(rank: int, world_size: int, rows: int) -> dict:   # module level, JSON in/out
        ...
        return {"ok": True}

    results = run_world(_worker, 4, 14, timeout=120)   # one result per rank, in rank order
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

_TAIL_CHARS = 4000


class WorldError(RuntimeError):
    """A worker of a spawned world failed; the message carries its rank and traceback."""


class WorldTimeout(WorldError):
    """A spawned world did not finish within its timeout and was killed."""


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-_TAIL_CHARS:]


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str | None = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes and return the
    per-rank return values (JSON round-tripped), in rank order.

    ``fn`` must be a module-level function of an importable file; ``args`` and its return value
    must be JSON-serialisable. With ``backend`` set (default gloo) every worker has joined the
    default process group before ``fn`` runs and leaves it afterwards; ``backend=None`` skips
    ``torch.distributed`` entirely. ``env`` adds variables to the workers' environment.
    Raises `WorldError` naming the first failed rank (with its traceback), or `WorldTimeout`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    source = inspect.getsourcefile(fn)
    if source is None or "<locals>" in fn.__qualname__:
        raise ValueError(f"{fn!r} must be a module-level function defined in a file")
    worker_env = _worker_env(env)
    with tempfile.TemporaryDirectory(prefix="awex_world_") as tmp:
        tmpdir = Path(tmp)
        procs: list[subprocess.Popen] = []
        logs = [tmpdir / f"log{rank}.txt" for rank in range(world_size)]
        try:
            for rank in range(world_size):
                spec = {
                    "file": str(Path(source).resolve()), "qualname": fn.__qualname__, "args": list(args),
                    "rank": rank, "world_size": world_size, "backend": backend,
                    "port_file": str(tmpdir / "port"), "timeout": timeout,
                    "result": str(tmpdir / f"result{rank}.json"), "error": str(tmpdir / f"error{rank}.txt"),
                }  # fmt: skip
                spec_path = tmpdir / f"spec{rank}.json"
                spec_path.write_text(json.dumps(spec))
                with logs[rank].open("wb") as out:
                    procs.append(subprocess.Popen(
                        [sys.executable, str(Path(__file__).resolve()), str(spec_path)],
                        stdout=out, stderr=subprocess.STDOUT, env=worker_env, start_new_session=True,
                    ))  # fmt: skip
            _wait_world(procs, logs, tmpdir, fn.__qualname__, timeout)
        finally:
            _kill(procs)
        return [json.loads((tmpdir / f"result{r}.json").read_text()) for r in range(world_size)]


def _worker_env(env: Mapping[str, str] | None) -> dict[str, str]:
    worker_env = dict(os.environ)
    worker_env.setdefault("OMP_NUM_THREADS", "1")
    worker_env["PYTHONUNBUFFERED"] = "1"
    worker_env["PYTHONFAULTHANDLER"] = "1"  # a crashing worker still leaves a Python stack
    if sys.platform.startswith("linux"):
        worker_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if env:
        worker_env.update(env)
    return worker_env


def _wait_world(procs: list[subprocess.Popen], logs: list[Path], tmpdir: Path, name: str,
                timeout: float) -> None:
    """Wait for every worker to exit 0; raise `WorldError` for the first failed rank, or
    `WorldTimeout` (with every running worker's stacks) past ``timeout``."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            _kill(procs)
            rank = failed[0]
            error = _tail(tmpdir / f"error{rank}.txt") or "(no traceback written)"
            raise WorldError(
                f"rank {rank} of {world_size} failed (exit code {codes[rank]}) in "
                f"{name}:\n{error}\n--- rank {rank} output ---\n{_tail(logs[rank])}"
            )
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            for r in running:  # each worker dumps every thread's stack into its log
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(1.0)
            _kill(procs)
            tails = "\n".join(f"--- rank {r} output ---\n{_tail(logs[r])}" for r in running)
            raise WorldTimeout(
                f"{name} on {world_size} ranks exceeded {timeout:.0f} s; "
                f"ranks still running: {running}\n{tails}"
            )
        time.sleep(0.05)


def _load_function(file: str, qualname: str) -> Callable[..., Any]:
    path = Path(file)
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_awex_world_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(spec_path: str) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks on timeout
    spec = json.loads(Path(spec_path).read_text())
    try:
        fn = _load_function(spec["file"], spec["qualname"])
        rank, world_size = spec["rank"], spec["world_size"]
        dist = None
        if spec["backend"] is not None:
            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=spec["timeout"])
            port_file = Path(spec["port_file"])
            if rank == 0:
                store = dist.TCPStore(
                    "127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
                )
                staging = port_file.with_suffix(".tmp")
                staging.write_text(str(store.port))
                staging.rename(port_file)  # atomic: readers never see a partial number
            else:
                deadline = time.monotonic() + spec["timeout"]
                while not port_file.exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {rank}: rank 0 published no store port")
                    time.sleep(0.02)
                port = int(port_file.read_text())
                store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
            dist.init_process_group(
                spec["backend"],
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
        try:
            result = fn(rank, world_size, *spec["args"])
        finally:
            if dist is not None and dist.is_initialized():
                dist.destroy_process_group()
        Path(spec["result"]).write_text(json.dumps(result))
    except BaseException:
        import traceback

        Path(spec["error"]).write_text(traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
