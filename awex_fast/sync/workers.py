"""The channels a `awex_fast.sync.pair.WeightSyncPair` reaches its workers through, all speaking
the JSON dispatch of `awex_fast.sync.routes` (nothing is pickled):

- an adapter object in this process (`LocalWorker`; any object with the protocol's methods);
- `HttpWorker`: a worker serving `awex_fast.sync.routes.worker_routes` (``/awex/*``);
- `KVWorker`: a worker process running `serve_kv_worker`, which takes commands from the KV store
  itself (keys ``worker_cmd_{id}_{seq}`` / ``worker_ret_{id}_{seq}`` of a channel namespace), for
  jobs that can open no port of their own. A replacement needs a fresh worker id.

Every channel has ``label`` (how errors name the worker), ``call(route, args, timeout)``
(async; `WorkerError` on failure) and ``close()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
from typing import Any

import aiohttp

from awex_fast.net import (
    ADMIN_KEY_ENV,
    KVStoreClient,
    KVTimeoutError,
    RetriesExhausted,
    auth_headers,
    error_message,
    request_with_retries,
)
from awex_fast.sync.routes import dispatch, error_text

_REPORTS = ("report_parallelism", "report_weight_meta")


class WorkerError(RuntimeError):
    """One worker call failed; ``worker`` labels the worker, ``route`` the call."""

    def __init__(self, worker: str, route: str, message: str) -> None:
        super().__init__(f"{worker}: {route} failed: {message}")
        self.worker, self.route, self.message = worker, route, message




class LocalWorker:
    """An adapter in this process; calls run on a private thread (one at a time) and their
    results are JSON round-tripped, so they behave as over HTTP."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.label = f"in-process {type(adapter).__name__}"
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="awex-local")

    async def call(self, route: str, args: dict[str, Any], timeout: float) -> Any:
        """Run ``route`` on the adapter (bounded wait; a timed-out call keeps its thread)."""
        loop = asyncio.get_running_loop()
        try:
            result = await asyncio.wait_for(
                loop.run_in_executor(self._pool, dispatch, self.adapter, route, args), timeout
            )
        except asyncio.TimeoutError:
            raise WorkerError(self.label, route, f"no answer within {timeout:.0f} s") from None
        except Exception as exc:
            raise WorkerError(self.label, route, error_text(exc)) from exc
        return json.loads(json.dumps(result))

    async def close(self) -> None:
        """Release the thread."""
        self._pool.shutdown(wait=False)


class HttpWorker:
    """A worker serving the ``/awex/*`` routes at ``url``. Reports are retried on connection
    errors; mutating calls never are (an update must not run twice)."""

    def __init__(self, url: str, admin_api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.label = self.url
        key = os.environ.get(ADMIN_KEY_ENV) if admin_api_key is None else admin_api_key
        self._headers = {"Content-Type": "application/json", **auth_headers(key)}
        self._session: aiohttp.ClientSession | None = None

    async def call(self, route: str, args: dict[str, Any], timeout: float) -> Any:
        """POST ``/awex/{route}`` and return its ``result``; `WorkerError` otherwise."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        try:
            status, body = await request_with_retries(self._session, "POST", f"{self.url}/awex/{route}",
                                                      data=json.dumps(args).encode(), headers=self._headers,
                                                      timeout=timeout, retries=2 if route in _REPORTS else 0,
                                                      backoff=0.2)
        except RetriesExhausted as exc:  # no answer, or a 5xx answer (exc.status) after the retries
            reason = exc.reason if exc.status is not None else f"unreachable: {exc.reason}"
            raise WorkerError(self.label, route, reason) from exc
        if status != 200:
            raise WorkerError(self.label, route, f"HTTP {status}: {error_message(body)}")
        return json.loads(body)["result"]

    async def close(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def cmd_key(worker_id: str, seq: int) -> str:
    """KV key of command ``seq`` for KV worker ``worker_id``."""
    return f"worker_cmd_{worker_id}_{seq}"


def ret_key(worker_id: str, seq: int) -> str:
    """KV key of the answer to command ``seq`` of KV worker ``worker_id``."""
    return f"worker_ret_{worker_id}_{seq}"


class KVWorker:
    """A worker running `serve_kv_worker` under ``channel`` / ``worker_id``, reached only through
    the KV store at ``kv_store_url``; ``poll_s`` bounds how long an answer waits unseen. Calls
    are numbered, so use one `KVWorker` object per worker (from any thread or loop)."""

    def __init__(self, kv_store_url: str, channel: str, worker_id: str, admin_api_key: str | None = None,
                 poll_s: float = 0.02) -> None:
        self.url, self.channel, self.worker_id, self.poll_s = kv_store_url, channel, worker_id, poll_s
        self.label = f"kv worker {worker_id}"
        self._key = admin_api_key
        self._kv: KVStoreClient | None = None
        self._seq = 0
        self._lock = threading.Lock()

    def request(self, route: str, args: dict[str, Any], timeout: float) -> Any:
        """Post the command and block for its answer (`WorkerError` after ``timeout``)."""
        with self._lock:
            if self._kv is None:
                self._kv = KVStoreClient(self.url, self._key)
            seq, self._seq = self._seq, self._seq + 1
            kv = self._kv
        kv.put(self.channel, cmd_key(self.worker_id, seq), {"route": route, "args": args})
        try:
            ret = kv.wait(self.channel, ret_key(self.worker_id, seq), timeout, max_interval=self.poll_s)
        except KVTimeoutError:
            raise WorkerError(self.label, route,
                              f"no answer within {timeout:.0f} s (is the worker alive?)") from None
        kv.delete(self.channel, ret_key(self.worker_id, seq))
        if not ret.get("ok"):
            raise WorkerError(self.label, route, str(ret.get("error")))
        return ret.get("result")

    async def call(self, route: str, args: dict[str, Any], timeout: float) -> Any:
        """`request` without blocking the caller's event loop."""
        return await asyncio.to_thread(self.request, route, args, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Tell the worker's `serve_kv_worker` loop to return, then close the KV client."""
        try:
            self.request("stop", {}, timeout)
        finally:
            with self._lock:
                kv, self._kv = self._kv, None
            if kv is not None:
                kv.close()

    async def close(self) -> None:
        """Close the KV client."""
        with self._lock:
            kv, self._kv = self._kv, None
        if kv is not None:
            kv.close()


def serve_kv_worker(adapter: Any, kv_store_url: str, channel: str, worker_id: str, *,
                    admin_api_key: str | None = None, poll_s: float = 0.02,
                    idle_timeout_s: float | None = None) -> int:
    """Execute the commands a `KVWorker` posts for ``worker_id`` until it sends "stop" (or
    nothing arrives for ``idle_timeout_s``); returns the number of commands run. Commands go
    through `awex_fast.sync.routes.dispatch`; a failing call is answered with its error."""
    if "/" in worker_id or not worker_id:
        raise ValueError(f"worker id {worker_id!r} must be non-empty and contain no '/'")
    kv = KVStoreClient(kv_store_url, admin_api_key)
    seq = 0
    try:
        while True:
            try:
                cmd = kv.wait(channel, cmd_key(worker_id, seq), idle_timeout_s or 3600.0, max_interval=poll_s)
            except KVTimeoutError:
                if idle_timeout_s is not None:
                    return seq
                continue
            route, args = cmd.get("route"), cmd.get("args", {})
            if route == "stop":
                ret: dict[str, Any] = {"ok": True, "result": None}
            else:
                try:
                    ret = {"ok": True, "result": dispatch(adapter, str(route), args)}
                except Exception as exc:  # noqa: BLE001 - reported to the controller, which decides
                    ret = {"ok": False, "error": error_text(exc), "type": type(exc).__name__}
            kv.delete(channel, cmd_key(worker_id, seq))
            kv.put(channel, ret_key(worker_id, seq), ret)
            seq += 1
            if route == "stop":
                return seq
    finally:
        kv.close()


def as_worker(worker: Any, admin_api_key: str | None = None) -> LocalWorker | HttpWorker | KVWorker:
    """A channel for ``worker``: channels pass through, a URL string becomes an `HttpWorker`,
    an adapter object a `LocalWorker`."""
    if isinstance(worker, (LocalWorker, HttpWorker, KVWorker)):
        return worker
    if isinstance(worker, str):
        return HttpWorker(worker, admin_api_key)
    if all(hasattr(worker, m) for m in ("get_weight_metadata", "execute_weight_update", "release_memory")):
        return LocalWorker(worker)
    raise TypeError(
        f"cannot use a {type(worker).__name__} as a weight-sync worker (adapter, URL, or channel)"
    )



__all__ = ["HttpWorker", "KVWorker", "LocalWorker", "WorkerError", "as_worker", "cmd_key", "ret_key",
           "serve_kv_worker"]
