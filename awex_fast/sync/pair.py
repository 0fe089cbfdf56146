"""WeightSyncPair: one controller connecting a training job and N inference engines; its HTTP
gateway (``awex-fast gateway``); the worker channels it drives.

Contract (the order of calls and what a failure leaves behind; DESIGN.md, "Who drives an
update"): `WeightSyncPair.connect` asks every worker for ``parallelism_strategy`` and its
metadata (side-local ranks), checks the sizes, publishes the merged metadata of each side in the
KV store (``training_params_meta`` / ``infer_params_meta``, see
`awex_fast.sync.adapters.encode_side_metas`), assigns transfer ranks (engines first, in order, by
prefix sums of their sizes; training after), calls ``init_weight_update_group`` on every worker
at once, checks that every rank mirrored the same ``plan_digest_rank{r}``, and warms the group
up with ``batch_isend_irecv``. `WeightSyncPair.update_weights` then runs both halves of one
update concurrently on every worker and returns ``{status, version, duration_ms, error}``
(plus ``reformed`` and per-worker ``workers`` results). When an update failed, the group is
gone: the next `update_weights` tears it down everywhere and re-forms it (reports, metadata,
init on a fresh port: transfer rank 0 binds port 0 and publishes the port, warm-up) before
sending, and says so (``reformed: true``). A dead worker is swapped with `replace_worker`.
Colocated pairs (``colocate=True``) call the ``*_colocate_*`` methods instead and form no group.

Workers are reached through one of three channels, all speaking the JSON dispatch of
`awex_fast.sync.routes` (nothing is pickled):

- an adapter object in this process (`LocalWorker`; any object with the protocol's methods);
- `HttpWorker`: a worker serving `awex_fast.sync.routes.worker_routes` (``/awex/*``);
- `KVWorker`: a worker process running `serve_kv_worker`, which takes commands from the KV store
  itself (keys ``worker_cmd_{id}_{seq}`` / ``worker_ret_{id}_{seq}`` of a channel namespace), for
  jobs that can open no port of their own. A replacement needs a fresh worker id.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from awex_fast.meta import ParameterMeta, merge_metas, metas_from_json
from awex_fast.net import (
    ADMIN_KEY_ENV,
    AsyncKVStoreClient,
    EventLoopThread,
    KVStore,
    KVStoreClient,
    KVTimeoutError,
    RetriesExhausted,
    add_kv_routes,
    auth_headers,
    check_bearer,
    error_message,
    json_error,
    json_error_middleware,
    read_json_body,
    request_with_retries,
    serve_app,
    serve_until_signal,
)
from awex_fast.sync.adapters import (
    INFER_META_KEY,
    MASTER_PORT_KEY,
    TRAINING_META_KEY,
    assemble_world,
    digest_key,
    encode_side_metas,
)
from awex_fast.sync.routes import dispatch, error_text

_REPORTS = ("report_parallelism", "report_weight_meta")


class PairError(RuntimeError):
    """The pair could not be connected or re-formed; the message names every failing worker."""


class WorkerError(RuntimeError):
    """One worker call failed; ``worker`` labels the worker, ``route`` the call."""

    def __init__(self, worker: str, route: str, message: str) -> None:
        super().__init__(f"{worker}: {route} failed: {message}")
        self.worker, self.route, self.message = worker, route, message


# --------------------------------------------------------------------------------------------
# Channels
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The controller
# --------------------------------------------------------------------------------------------


class WeightSyncPair:
    """Connects one training job (``training``: its workers in training-rank order) and N
    engines (``engines``: per engine, its workers in engine-rank order); see the module
    docstring for the contract. Workers are adapters, URLs or channels (`as_worker`).

    ``admin_api_key`` (default ``$AWEX_FAST_ADMIN_KEY``) authenticates to the KV store and to
    HTTP workers. ``master_port=0`` (default) re-forms every group on a port the OS chose; a
    fixed port is used for the first group and ``master_port + n`` for the n-th re-formation.
    ``timeout_s`` bounds every worker call. ``bucket_bytes`` (published with the metadata)
    overrides the bucket size the adapters were built with, so that every rank plans alike.
    """

    def __init__(self, pair_name: str, kv_store_url: str, training: Sequence[Any],
                 engines: Sequence[Sequence[Any]], *, admin_api_key: str | None = None,
                 colocate: bool = False, master_addr: str = "127.0.0.1", master_port: int = 0,
                 timeout_s: float = 120.0, warmup: bool = True, bucket_bytes: int | None = None) -> None:
        if not training or not engines or not all(engines):
            raise ValueError("a pair needs at least one training worker and one non-empty engine")
        if "/" in pair_name or not pair_name:
            raise ValueError(f"pair name {pair_name!r} must be non-empty and contain no '/'")
        self.pair_name, self.kv_store_url = pair_name, kv_store_url
        self.admin_api_key = os.environ.get(ADMIN_KEY_ENV) if admin_api_key is None else admin_api_key
        self.training = [as_worker(w, self.admin_api_key) for w in training]
        self.engines = [[as_worker(w, self.admin_api_key) for w in e] for e in engines]
        self.colocate, self.master_addr, self.master_port = colocate, master_addr, int(master_port)
        self.timeout_s, self.warmup = float(timeout_s), warmup
        self.bucket_bytes = bucket_bytes
        self.connected = False
        self.needs_reform = False
        self.generation = 0
        self._loop = EventLoopThread(name=f"awex-pair-{pair_name}")
        self._kv: AsyncKVStoreClient | None = None

    # --- bookkeeping ----------------------------------------------------------------------------

    @property
    def engine_sizes(self) -> list[int]:
        """Ranks per engine."""
        return [len(e) for e in self.engines]

    @property
    def infer_world_size(self) -> int:
        """Inference ranks in all."""
        return sum(self.engine_sizes)

    def _workers(self) -> list[tuple[str, int, int, Any]]:
        """(label, transfer rank, side-local rank, channel) of every worker, transfer-rank order."""
        out, rank = [], 0
        for e, engine in enumerate(self.engines):
            for r, w in enumerate(engine):
                out.append((f"engine {e} rank {r} ({w.label})", rank, r, w))
                rank += 1
        for t, w in enumerate(self.training):
            out.append((f"training rank {t} ({w.label})", rank, t, w))
            rank += 1
        return out

    def _side_size(self, transfer_rank: int) -> int:
        """Workers on the side (the engine, or the training job) of ``transfer_rank``."""
        for size in self.engine_sizes:
            if transfer_rank < size:
                return size
            transfer_rank -= size
        return len(self.training)

    @property
    def transfer_ranks(self) -> dict[str, int]:
        """Worker label -> transfer rank."""
        return {label: rank for label, rank, _, _ in self._workers()}

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro, None)

    async def _gather(self, route: str, args_of: Any, timeout: float | None = None) -> tuple[list[Any],
                      list[str]]:
        """Call ``route`` on every worker at once; (results in worker order, error strings)."""
        workers = self._workers()
        timeout = self.timeout_s if timeout is None else timeout
        calls = [w.call(route, args_of(rank, local) if callable(args_of) else args_of, timeout)
                 for _, rank, local, w in workers]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = []
        for (label, *_), res in zip(workers, results, strict=True):
            if isinstance(res, BaseException):
                errors.append(f"{label}: {res.message if isinstance(res, WorkerError) else error_text(res)}")
        return [None if isinstance(r, BaseException) else r for r in results], errors

    async def _kv_now(self) -> AsyncKVStoreClient:
        if self._kv is None:
            self._kv = AsyncKVStoreClient(self.kv_store_url, self.admin_api_key or "")
        return self._kv

    # --- forming the group ----------------------------------------------------------------------

    async def _publish(self) -> dict[str, Any]:
        reports, errors = await self._gather("report_parallelism", {})
        if errors:
            raise PairError("reporting parallelism failed: " + "; ".join(errors))
        workers = self._workers()
        for (label, rank, local, _), rep in zip(workers, reports, strict=True):
            want = self._side_size(rank)
            if rep.get("world_size") != want:
                raise PairError(
                    f"{label} reports world_size {rep.get('world_size')} but the pair gives its side "
                    f"{want} workers"
                )
            if "rank" in rep and rep["rank"] != local:
                raise PairError(f"{label} reports rank {rep['rank']} but sits at position {local}")
        blobs, errors = await self._gather("report_weight_meta", {})
        if errors:
            raise PairError("reporting metadata failed: " + "; ".join(errors))
        metas = [metas_from_json(base64.b64decode(b["metas"])) for b in blobs]
        n_inf = self.infer_world_size
        groups: list[list[ParameterMeta]] = []
        start = 0
        for size in self.engine_sizes:
            groups.append(merge_metas(metas[start : start + size]))
            start += size
        train_value = encode_side_metas("training", [merge_metas(metas[n_inf:])], [len(self.training)],
                                        bucket_bytes=self.bucket_bytes)
        infer_value = encode_side_metas("inference", groups, self.engine_sizes)
        assemble_world(train_value, infer_value, infer_world_size=n_inf, train_world_size=len(self.training),
                       num_engines=len(self.engines))  # checks ranks against sizes before anyone plans
        kv = await self._kv_now()
        await kv.put(self.pair_name, TRAINING_META_KEY, train_value)
        await kv.put(self.pair_name, INFER_META_KEY, infer_value)
        await kv.delete(self.pair_name, MASTER_PORT_KEY)
        for _, rank, _, _ in workers:
            await kv.delete(self.pair_name, digest_key(rank))
        return {"parallelism": {label: rep for (label, *_), rep in zip(workers, reports, strict=True)}}

    def _port(self) -> int:
        return 0 if self.master_port == 0 else self.master_port + self.generation

    async def _form(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        info = await self._publish()
        n_inf, n_train = self.infer_world_size, len(self.training)
        world = n_inf + n_train
        if self.colocate:

            def colocate_args(rank: int, _local: int) -> dict[str, Any]:
                args = {"pair_name": self.pair_name, "kv_store_url": self.kv_store_url, "transfer_rank": rank,
                        "infer_world_size": n_inf, "train_world_size": n_train,
                        "num_engines": len(self.engines), "master_port": self._port(),
                        "timeout_s": self.timeout_s}
                if self.admin_api_key:  # else the seed default: each adapter keeps its own key
                    args["admin_api_key"] = self.admin_api_key
                return args

            inits, errors = await self._gather("init_colocate_weight_update", colocate_args)
            if errors:
                raise PairError("init_colocate_weight_update failed: " + "; ".join(errors))
            info["init"] = {label: r for (label, *_), r in zip(self._workers(), inits, strict=True)}
        else:

            def init_args(rank: int, _local: int) -> dict[str, Any]:
                return {"pair_name": self.pair_name, "master_addr": self.master_addr,
                        "master_port": self._port(), "transfer_rank": rank, "world_size": world,
                        "kv_store_url": self.kv_store_url, "infer_world_size": n_inf,
                        "train_world_size": n_train, "num_engines": len(self.engines)}

            inits, errors = await self._gather("init_weights_update_group", init_args, self.timeout_s + 30)
            if errors:
                raise PairError("init_weight_update_group failed: " + "; ".join(errors))
            kv = await self._kv_now()
            digests = {rank: await kv.get(self.pair_name, digest_key(rank))
                       for _, rank, _, _ in self._workers()}
            if len(set(digests.values())) != 1:
                raise PairError(
                    f"transfer ranks planned from different metadata or settings: digests {digests}"
                )
            info["digest"] = digests[0]
            info["init"] = {label: r for (label, *_), r in zip(self._workers(), inits, strict=True)}
            info["peers"] = {label: r.get("peers") for label, r in info["init"].items()}
            if self.warmup:
                _, errors = await self._gather("batch_isend_irecv", {"timeout_s": self.timeout_s})
                if errors:
                    raise PairError("warm-up (batch_isend_irecv) failed: " + "; ".join(errors))
        self.needs_reform = False
        info["seconds"] = time.perf_counter() - t0
        info["transfer_ranks"] = self.transfer_ranks
        return info

    async def _teardown_all(self) -> list[str]:
        _, errors = await self._gather("teardown", {}, min(self.timeout_s, 30.0))
        return errors

    # --- public API -----------------------------------------------------------------------------

    def connect(self) -> dict[str, Any]:
        """Form the pair (module docstring); returns {"parallelism", "init" (each worker's init
        result), "digest", "peers", "transfer_ranks", "seconds"}. Raises `PairError` naming every
        failing worker."""
        try:
            info = self._run(self._form())
        except PairError:
            self.needs_reform = True
            raise
        self.connected = True
        return info

    def update_weights(self, version: int) -> dict[str, Any]:
        """One update on every worker; {"status": "ok"|"failed", "version", "duration_ms",
        "error" (None or every failing worker's message), "reformed", "workers"}."""
        t0 = time.perf_counter()
        out: dict[str, Any] = {"status": "failed", "version": int(version), "reformed": False, "error": None,
                  "workers": {}}
        try:
            out.update(self._run(self._update(int(version), out)))
        except PairError as exc:
            self.needs_reform = True
            out["error"] = str(exc)
        out["duration_ms"] = (time.perf_counter() - t0) * 1e3
        return out

    async def _update(self, version: int, out: dict[str, Any]) -> dict[str, Any]:
        if not self.connected:
            raise PairError(f"pair {self.pair_name!r} is not connected; call connect() first")
        if self.needs_reform:
            self.generation += 1
            teardown_errors = await self._teardown_all()
            try:
                await self._form()
            except PairError as exc:
                raise PairError(f"re-forming the group after a failed update failed: {exc}") from exc
            out["reformed"] = True
            out["teardown_errors"] = teardown_errors
        route = "execute_colocate_weight_update" if self.colocate else "update_weights"
        results, errors = await self._gather(route, {"version": version}, self.timeout_s + 30)
        workers = {label: r for (label, *_), r in zip(self._workers(), results, strict=True)}
        if errors:
            self.needs_reform = True
            return {"status": "failed", "error": "; ".join(errors), "workers": workers}
        return {"status": "ok", "error": None, "workers": workers}

    def _side(self, side: str) -> list[Any]:
        if side == "training":
            return list(self.training)
        if side == "inference":
            return [w for e in self.engines for w in e]
        raise ValueError(f"side must be 'training' or 'inference', got {side!r}")

    def _memory(self, route: str, side: str, tags: list[str] | None) -> list[Any]:
        async def run() -> list[Any]:
            workers = self._side(side)
            return await asyncio.gather(*(w.call(route, {"tags": tags}, self.timeout_s) for w in workers))

        return self._run(run())

    def release_memory(self, side: str, tags: list[str] | None = None) -> list[Any]:
        """``release_memory(tags)`` on every worker of ``side`` ("training" or "inference");
        their results in rank order. Colocated training workers may release only after an update
        returned (every reader acknowledged)."""
        return self._memory("release_memory", side, tags)

    def resume_memory(self, side: str, tags: list[str] | None = None) -> list[Any]:
        """``resume_memory(tags)`` on every worker of ``side``; their results in rank order."""
        return self._memory("resume_memory", side, tags)

    def replace_worker(self, side: str, rank: int, worker: Any, engine: int = 0) -> None:
        """Put ``worker`` in the place of a dead one (training rank ``rank``, or rank ``rank`` of
        ``engine``); the next `update_weights` re-forms the group around it."""
        new = as_worker(worker, self.admin_api_key)
        if side == "training":
            self.training[rank] = new
        elif side == "inference":
            self.engines[engine][rank] = new
        else:
            raise ValueError(f"side must be 'training' or 'inference', got {side!r}")
        self.needs_reform = True

    def disconnect(self) -> dict[str, Any]:
        """Tear the group down on every worker; returns {"errors": [...]} (dead workers)."""
        errors = self._run(self._teardown_all())
        self.connected = False
        return {"errors": errors}

    def close(self) -> None:
        """Close every channel and the private loop (after `disconnect`)."""

        async def close_all() -> None:
            for w in [*self.training, *(w for e in self.engines for w in e)]:
                await w.close()
            if self._kv is not None:
                await self._kv.close()

        try:
            self._run(close_all())
        finally:
            self._loop.stop()


# --------------------------------------------------------------------------------------------
# Gateway: the controller over HTTP (awex-fast gateway)
# --------------------------------------------------------------------------------------------


GATEWAY_STATE: web.AppKey[dict[str, Any]] = web.AppKey("awex_gateway_state", dict)


def _pair_body(body: dict[str, Any], route: str) -> str:
    name = body.get("pair_name")
    if not isinstance(name, str) or not name:
        raise json_error(400, f"{route}: field 'pair_name' must be a non-empty string")
    return name


def gateway_app(admin_api_key: str | None = None, *, kv_store: KVStore | None = None, serve_kv: bool = True,
                allow_anonymous_reads: bool = False, max_body_bytes: int = 256 << 20) -> web.Application:
    """The gateway: a `WeightSyncPair` per pair name over HTTP workers, and (``serve_kv``) the KV
    store routes of `awex_fast.net.kvstore` on the same app, as AReaL's gateway serves both.

    - ``POST /connect`` ``{"pair_name", "training": [url, ...], "engines": [[url, ...], ...],
      "kv_store_url"?, "colocate"?, "master_addr"?, "master_port"?, "timeout_s"?, "warmup"?,
      "bucket_bytes"?, "worker_admin_key"?}`` -> ``{"status": "ok", "result": <connect result>}``
      (500 naming the failing workers). Connecting an existing name disconnects the old pair first.
    - ``POST /update_weights`` ``{"pair_name", "version"}`` -> the `WeightSyncPair.update_weights`
      dict (HTTP 200 whatever the update's ``status``).
    - ``POST /release_memory`` / ``/resume_memory`` ``{"pair_name", "side", "tags"?}``.
    - ``POST /disconnect`` ``{"pair_name"}``; ``GET /health`` -> ``{"status", "pairs"}``.

    Every route but ``/health`` needs ``Authorization: Bearer <admin key>`` (default
    ``$AWEX_FAST_ADMIN_KEY``); ``kv_store_url`` defaults to this gateway's own address.
    """
    key = os.environ.get(ADMIN_KEY_ENV) if admin_api_key is None else admin_api_key
    if not key:
        raise ValueError(f"gateway_app: an admin key is required (pass it or set {ADMIN_KEY_ENV})")
    app = web.Application(middlewares=[json_error_middleware], client_max_size=max_body_bytes)
    pairs: dict[str, WeightSyncPair] = {}
    state: dict[str, Any] = {"kv_store_url": None}  # filled in once the gateway listens
    app[GATEWAY_STATE] = state
    if serve_kv:
        add_kv_routes(app, kv_store if kv_store is not None else KVStore(), key,
                      allow_anonymous_reads=allow_anonymous_reads, max_body_bytes=max_body_bytes)

    async def body_of(request: web.Request, route: str) -> dict[str, Any]:
        check_bearer(request, key)
        body = await read_json_body(request, 1 << 20)
        if not isinstance(body, dict):
            raise json_error(400, f"{route}: body must be a JSON object")
        return body

    def pair_of(name: str) -> WeightSyncPair:
        pair = pairs.get(name)
        if pair is None:
            raise json_error(404, f"pair {name!r} is not connected", pair_name=name)
        return pair

    async def connect(request: web.Request) -> web.Response:
        body = await body_of(request, "connect")
        name = _pair_body(body, "connect")
        training, engines = body.get("training"), body.get("engines")
        if not (isinstance(training, list) and training and all(isinstance(u, str) for u in training)):
            raise json_error(400, "connect: 'training' must be a non-empty list of worker URLs")
        if not (
            isinstance(engines, list)
            and engines
            and all(isinstance(e, list) and e and all(isinstance(u, str) for u in e) for e in engines)
        ):
            raise json_error(400,
                             "connect: 'engines' must be a non-empty list of non-empty lists of worker URLs")
        kv_url = body.get("kv_store_url") or state["kv_store_url"] or str(request.url.origin())
        worker_key = body.get("worker_admin_key") or key
        old = pairs.pop(name, None)
        if old is not None:
            await asyncio.to_thread(old.disconnect)
            await asyncio.to_thread(old.close)
        try:
            pair = WeightSyncPair(
                name,
                kv_url,
                [HttpWorker(u, worker_key) for u in training],
                [[HttpWorker(u, worker_key) for u in e] for e in engines],
                admin_api_key=key,
                colocate=bool(body.get("colocate", False)),
                master_addr=str(body.get("master_addr", "127.0.0.1")),
                master_port=int(body.get("master_port", 0)),
                timeout_s=float(body.get("timeout_s", 120.0)),
                warmup=bool(body.get("warmup", True)),
                bucket_bytes=int(body["bucket_bytes"]) if body.get("bucket_bytes") else None,
            )
        except (TypeError, ValueError) as exc:
            raise json_error(400, f"connect: {exc}") from None
        try:
            result = await asyncio.to_thread(pair.connect)
        except PairError as exc:
            await asyncio.to_thread(pair.close)
            raise json_error(500, str(exc), pair_name=name) from None
        pairs[name] = pair
        return web.json_response({"status": "ok", "pair_name": name, "result": result})

    async def update(request: web.Request) -> web.Response:
        body = await body_of(request, "update_weights")
        pair = pair_of(_pair_body(body, "update_weights"))
        version = body.get("version")
        if type(version) is not int:
            raise json_error(400, f"update_weights: 'version' must be an integer, got {version!r}")
        return web.json_response(await asyncio.to_thread(pair.update_weights, version))

    def memory(route: str) -> Any:
        async def handle(request: web.Request) -> web.Response:
            body = await body_of(request, route)
            pair = pair_of(_pair_body(body, route))
            side, tags = body.get("side"), body.get("tags")
            if side not in ("training", "inference"):
                raise json_error(400, f"{route}: 'side' must be 'training' or 'inference', got {side!r}")
            try:
                result = await asyncio.to_thread(getattr(pair, route), side, tags)
            except WorkerError as exc:
                raise json_error(500, str(exc)) from None
            return web.json_response({"status": "ok", "result": result})

        return handle

    async def disconnect(request: web.Request) -> web.Response:
        body = await body_of(request, "disconnect")
        name = _pair_body(body, "disconnect")
        pair = pair_of(name)
        del pairs[name]
        result = await asyncio.to_thread(pair.disconnect)
        await asyncio.to_thread(pair.close)
        return web.json_response({"status": "ok", "result": result})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy", "pairs": sorted(pairs)})

    async def cleanup(_: web.Application) -> None:
        for pair in list(pairs.values()):
            await asyncio.to_thread(pair.close)

    app.router.add_post("/connect", connect)
    app.router.add_post("/update_weights", update)
    app.router.add_post("/release_memory", memory("release_memory"))
    app.router.add_post("/resume_memory", memory("resume_memory"))
    app.router.add_post("/disconnect", disconnect)
    app.router.add_get("/health", health)
    app.on_cleanup.append(cleanup)
    return app


async def _serve_gateway(app: web.Application, host: str, port: int) -> int:
    try:
        served = await serve_app(app, host, port)
    except OSError as exc:
        print(f"awex-fast gateway: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    app[GATEWAY_STATE]["kv_store_url"] = served.url
    banner = f"awex-fast gateway: serving at {served.url}; SIGINT/SIGTERM stops"
    return await serve_until_signal(served.url, banner, served.close)


def gateway_main(argv: list[str] | None = None) -> int:
    """``awex-fast gateway``: serve `gateway_app` until SIGINT/SIGTERM; returns the exit code.
    The first stdout line is the URL (``--port 0`` lets the OS choose). 0 after a signal, 1 when
    the address cannot be bound, 2 for bad arguments or no admin key."""
    parser = argparse.ArgumentParser(prog="awex-fast gateway",
                                     description="Weight-sync pair controller (and KV store) over HTTP.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 lets the OS choose (default)")
    parser.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                        help=f"bearer key (default ${ADMIN_KEY_ENV}; prefer the variable)")
    parser.add_argument("--no-kv-store", action="store_true", help="do not serve the KV store routes")
    parser.add_argument("--allow-anonymous-reads", action="store_true", help="KV reads without the key")
    args = parser.parse_args(argv)
    if not args.admin_key:
        print(f"awex-fast gateway: no admin key; pass --admin-key or set {ADMIN_KEY_ENV}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"awex-fast gateway: --port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    app = gateway_app(args.admin_key, serve_kv=not args.no_kv_store,
                      allow_anonymous_reads=args.allow_anonymous_reads)
    return asyncio.run(_serve_gateway(app, args.host, args.port))


__all__ = ["HttpWorker", "KVWorker", "LocalWorker", "PairError", "WeightSyncPair", "WorkerError", "as_worker",
           "gateway_app", "gateway_main", "serve_kv_worker"]


if __name__ == "__main__":
    sys.exit(gateway_main())
