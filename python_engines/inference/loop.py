"""The engine loop of TP rank 0 (`EngineLoop`): control commands (weight updates, pause, version
changes) run on the scheduler's thread between two steps, so HTTP never races a forward pass; see
`python_engines.inference.server` for the process layout and the update semantics."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from python_engines.inference.config import ServerConfig
from python_engines.inference.scheduler import Scheduler
from python_engines.inference.worker import Worker

__all__ = ["EngineLoop", "UpdateFailed"]

logger = logging.getLogger(__name__)


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
