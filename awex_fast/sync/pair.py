"""WeightSyncPair: one controller connecting a training job and N inference engines.

Contract (the order of calls and what a failure leaves behind; docs/DESIGN.md, "Who drives
an update"): `WeightSyncPair.connect` asks every worker for ``parallelism_strategy`` and its
metadata (side-local ranks), checks the sizes, publishes the merged metadata of each side in the
KV store (``training_params_meta`` / ``infer_params_meta``, see `awex_fast.sync.join`, whose
steps it runs for both sides), assigns transfer ranks (engines first, in order, by prefix sums
of their sizes; training after), calls ``init_weight_update_group`` on every worker at once,
checks that every rank mirrored the same ``plan_digest_rank{r}``, and warms the group up with
``batch_isend_irecv``. `WeightSyncPair.update_weights` then runs both halves of one update
concurrently on every worker and returns ``{status, version, duration_ms, error}`` (plus
``reformed`` and per-worker ``workers`` results). When an update failed, the group is gone: the
next `update_weights` tears it down everywhere and re-forms it (reports, metadata, init on a
fresh port: transfer rank 0 binds port 0 and publishes the port, warm-up) before sending, and
says so (``reformed: true``). A dead worker is swapped with `replace_worker`. Colocated pairs
(``colocate=True``) call the ``*_colocate_*`` methods instead and form no group.

Workers are adapters in this process, URLs of ``/awex/*`` routes, or KV-store channels
(`awex_fast.sync.workers`); the controller over HTTP is `awex_fast.sync.gateway`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any

from awex_fast.meta import merge_metas
from awex_fast.net import ADMIN_KEY_ENV, EventLoopThread, KVStoreClient
from awex_fast.sync.join import (
    JoinError,
    World,
    assemble_world,
    check_digests,
    encode_side_metas,
    merge_per_engine,
    put_side,
    read_report,
    reset_group_keys,
)
from awex_fast.sync.routes import error_text
from awex_fast.sync.workers import WorkerError, as_worker


class PairError(RuntimeError):
    """The pair could not be connected or re-formed; the message names every failing worker."""


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
        self._kv: KVStoreClient | None = None

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

    async def _kv_do(self, fn: Any, *args: Any) -> Any:
        """Run the join step ``fn(kv, pair, *args)`` on a worker thread (the steps are blocking)."""
        if self._kv is None:
            self._kv = KVStoreClient(self.kv_store_url, self.admin_api_key or "")
        return await asyncio.to_thread(fn, self._kv, self.pair_name, *args)

    # --- forming the group ----------------------------------------------------------------------

    async def _check_parallelism(self) -> list[Any]:
        """Every worker's ``parallelism_strategy``, checked against its place in the pair."""
        reports, errors = await self._gather("report_parallelism", {})
        if errors:
            raise PairError("reporting parallelism failed: " + "; ".join(errors))
        for (label, rank, local, _), rep in zip(self._workers(), reports, strict=True):
            want = self._side_size(rank)
            if rep.get("world_size") != want:
                raise PairError(
                    f"{label} reports world_size {rep.get('world_size')} but the pair gives its side "
                    f"{want} workers"
                )
            if "rank" in rep and rep["rank"] != local:
                raise PairError(f"{label} reports rank {rep['rank']} but sits at position {local}")
        return reports

    async def _publish(self) -> dict[str, Any]:
        """Join steps 1-2 (`awex_fast.sync.join`) for both sides: reports, merge, publish."""
        reports = await self._check_parallelism()
        answers, errors = await self._gather("report_weight_meta", {})
        if errors:
            raise PairError("reporting metadata failed: " + "; ".join(errors))
        workers = self._workers()
        metas = [read_report(a, what=f"{label}: report_weight_meta")
                 for (label, *_), a in zip(workers, answers, strict=True)]
        n_inf = self.infer_world_size
        train_value = encode_side_metas("training", [merge_metas(metas[n_inf:])], [len(self.training)],
                                        bucket_bytes=self.bucket_bytes)
        infer_value = encode_side_metas("inference", merge_per_engine(metas[:n_inf], self.engine_sizes),
                                        self.engine_sizes)
        assemble_world(train_value, infer_value, infer_world_size=n_inf, train_world_size=len(self.training),
                       num_engines=len(self.engines))  # checks ranks against sizes before anyone plans
        await self._kv_do(reset_group_keys, [rank for _, rank, _, _ in workers])
        await self._kv_do(put_side, train_value)
        await self._kv_do(put_side, infer_value)
        return {"parallelism": {label: rep for (label, *_), rep in zip(workers, reports, strict=True)}}

    def _port(self) -> int:
        return 0 if self.master_port == 0 else self.master_port + self.generation

    @property
    def world(self) -> World:
        """The transfer world's sizes (engines first, then the training job)."""
        return World(tuple(self.engine_sizes), len(self.training))

    async def _form(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        info = await self._publish()
        if self.colocate:
            await self._init_colocate(info)
        else:
            await self._init_group(info)
        self.needs_reform = False
        info["seconds"] = time.perf_counter() - t0
        info["transfer_ranks"] = self.transfer_ranks
        return info

    async def _init_colocate(self, info: dict[str, Any]) -> None:
        common = self.world.common_args(self.pair_name, self.kv_store_url)

        def colocate_args(rank: int, _local: int) -> dict[str, Any]:
            args = {**common, "transfer_rank": rank, "master_port": self._port(), "timeout_s": self.timeout_s}
            if self.admin_api_key:  # else the seed default: each adapter keeps its own key
                args["admin_api_key"] = self.admin_api_key
            return args

        inits, errors = await self._gather("init_colocate_weight_update", colocate_args)
        if errors:
            raise PairError("init_colocate_weight_update failed: " + "; ".join(errors))
        info["init"] = {label: r for (label, *_), r in zip(self._workers(), inits, strict=True)}

    async def _init_group(self, info: dict[str, Any]) -> None:
        world, port = self.world, self._port()

        def init_args(rank: int, _local: int) -> dict[str, Any]:
            return world.init_args(self.pair_name, self.kv_store_url, self.master_addr, port, rank)

        inits, errors = await self._gather("init_weights_update_group", init_args, self.timeout_s + 30)
        if errors:
            raise PairError("init_weight_update_group failed: " + "; ".join(errors))
        try:
            info["digest"] = await self._kv_do(check_digests, range(world.world_size))
        except JoinError as exc:
            raise PairError(str(exc)) from exc
        info["init"] = {label: r for (label, *_), r in zip(self._workers(), inits, strict=True)}
        info["peers"] = {label: r.get("peers") for label, r in info["init"].items()}
        if self.warmup:
            _, errors = await self._gather("batch_isend_irecv", {"timeout_s": self.timeout_s})
            if errors:
                raise PairError("warm-up (batch_isend_irecv) failed: " + "; ".join(errors))

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
                await asyncio.to_thread(self._kv.close)

        try:
            self._run(close_all())
        finally:
            self._loop.stop()



__all__ = ["PairError", "WeightSyncPair"]
