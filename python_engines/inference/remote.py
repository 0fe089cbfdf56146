"""`RemoteInferenceEngine`: the seed `InferenceEngine` over one or more inference servers.

Why a client engine: the RL loop (AReaL-style) owns the training processes and talks to
inference servers over HTTP (routes in docs/http.md). This engine spreads requests round robin,
resumes generations that a pause interrupted, drives weight updates on every server, and runs
rollout workflows through `python_engines.workflow.WorkflowExecutor`.

Contract:

- ``agenerate(req)`` (``req.gconfig.n_samples`` must be 1; workflows ask n times): sends
  ``/generate``; when the answer's stop reason is ``"interrupt"`` (someone called
  ``/pause_generation``), waits while this client is paused, then resubmits prompt + output so
  far with the remaining token budget, until ``"stop"`` or ``"length"``. A server that refuses
  because its weights are invalid (a failed update) raises `GenerationRefused` at once;
  connection errors, timeouts and other 5xx are retried ``request_retries`` times.
- ``update_weights(meta)`` returns a Future. ``"disk"``: wait (up to ``request_timeout``) for the
  trainer's version marker in ``meta.path`` to reach ``meta.version`` (default: this client's
  current version; see `python_engines.api`), then POST ``/update_weights_from_disk`` to every
  server. ``"awex"``: the awex_fast receive half, ``execute_weight_update(version)`` on every TP rank
  of every server (``meta.version``, default this client's version + 1). The Future's result
  lists each rank's answer; with ``meta.version`` set, the client's version becomes it.
- The awex group: when every server holds one that this client did not join (a `WeightSyncPair`
  or AReaL's gateway formed it), the update only receives. Otherwise the client joins the
  servers itself, with no controller, on the first awex update (and again when the pair fields
  of ``meta`` change, a server holds no group, or after a failed update), by the rule the
  training side follows (`python_engines.train.engine`, docs/DESIGN.md "Who drives an update"):
  every TP rank leaves any old group; the client collects every rank's side-local metadata,
  merges it per server (one engine per server, in address order), deletes a stale
  ``transfer_master_port``, publishes ``infer_params_meta`` (`awex_fast.sync.join`'s
  `publish_side`, the engine sizes = TP sizes), waits for ``training_params_meta`` for the
  training world size, then every TP rank calls ``init_weight_update_group`` at once, with
  transfer rank = prefix sum of the earlier servers' TP sizes + its TP rank (master port 0:
  inference transfer rank 0 binds and publishes one). The join runs in the Future, so the
  trainer's ``upload_weights(meta)`` joins concurrently. A failed join raises
  `WeightSyncJoinError` naming the step; the servers are left with no group.
- ``pause()`` stops new rollout episodes *and* interrupts generation on every server;
  ``resume()`` undoes both. ``set_version(v)`` sets the version here and on every server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from awex_fast.meta import ParameterMeta
from awex_fast.net import EventLoopThread, KVStoreClient, auth_headers, backoff_delay, error_message
from awex_fast.sync import (
    JoinError,
    World,
    merge_per_engine,
    publish_side,
    read_report,
    reset_group_keys,
    run_step,
    wait_side,
)
from python_engines.api import (
    FinetuneSpec,
    InferenceEngine,
    InferenceEngineConfig,
    LLMRequest,
    LLMResponse,
    RolloutWorkflow,
    WeightUpdateMeta,
    wait_for_weight_version,
)

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["GenerationRefused", "InferenceEngineConfig", "RemoteInferenceEngine", "ServerError",
           "WeightSyncJoinError"]


class ServerError(RuntimeError):
    """A server answered an error; ``status`` and ``url`` say which."""

    def __init__(self, message: str, status: int | None, url: str) -> None:
        """Keep the status and the URL next to the message."""
        super().__init__(message)
        self.status = status
        self.url = url


class GenerationRefused(ServerError):
    """The server refuses generation because its weights are invalid (a failed update)."""


class WeightSyncJoinError(JoinError):
    """A controller-less awex join failed; ``step`` names the step that did (module docstring),
    ``pair`` / ``kv_url`` the pair and its KV store (an ``awex_fast.sync.JoinError``)."""


class RemoteInferenceEngine(InferenceEngine):
    """HTTP client engine over inference servers; see the module docstring."""

    def __init__(self, config: InferenceEngineConfig) -> None:
        """Store the configuration; connect in `initialize`."""
        self.config = config
        self.addresses: list[str] = []
        self.tp_sizes: dict[str, int] = {}
        self._rr = itertools.count()
        self._version = 0
        self._resumed = threading.Event()
        self._resumed.set()
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._control: EventLoopThread | None = None
        self._update_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.executor: Any = None
        #: Pair fields of the awex group this client joined (None: it joined none); set and read
        #: on the update thread only.
        self._joined: tuple[str, str, str, int] | None = None
        self._rejoin = False

    # ------------------------------------------------------------------------------ lifecycle

    def initialize(self, addr: str | list[str] | None = None, ft_spec: FinetuneSpec | None = None) -> None:
        """Connect to ``addr`` (a URL, a list of URLs, or None: ``config.server_addrs``); waits up
        to ``setup_timeout`` for every server's ``/health``. ``ft_spec`` is unused."""
        from python_engines.workflow import WorkflowExecutor

        addrs = [addr] if isinstance(addr, str) else list(addr or self.config.server_addrs)
        if not addrs:
            raise ValueError("RemoteInferenceEngine.initialize: no server address given (addr or "
                             "InferenceEngineConfig.server_addrs)")
        self.addresses = [a if a.startswith("http") else f"http://{a}" for a in addrs]
        self.addresses = [a.rstrip("/") for a in self.addresses]
        self._control = EventLoopThread(name="awex-fast-client")
        self._update_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="awex-fast-update")
        self._control.run(self._wait_healthy(), self.config.setup_timeout + 5)
        self.executor = WorkflowExecutor(self.config, self, self.config.num_clients)
        self.executor.initialize()

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.setup_timeout
        async with self._client() as session:
            for url in self.addresses:
                health = await self._wait_one(session, url, deadline)
                self.tp_sizes[url] = int(health.get("tp_size", 1))

    async def _wait_one(self, session: aiohttp.ClientSession, url: str, deadline: float) -> dict:
        while True:
            try:
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        return await resp.json()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server {url} not healthy after {self.config.setup_timeout} s")
            await asyncio.sleep(0.2)

    def destroy(self) -> None:
        """Close connections and stop the rollout executor (idempotent)."""
        for loop, session in list(self._sessions.items()):
            if not loop.is_closed() and loop.is_running():
                with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                    asyncio.run_coroutine_threadsafe(session.close(), loop).result(5.0)
        self._sessions.clear()
        if self.executor is not None:
            self.executor.destroy()
            self.executor = None
        if self._update_pool is not None:
            self._update_pool.shutdown(wait=False, cancel_futures=True)
            self._update_pool = None
        if self._control is not None:
            self._control.stop()
            self._control = None

    def _owned_loops(self) -> set[asyncio.AbstractEventLoop]:
        loops = set()
        if self._control is not None:
            loops.add(self._control.loop)
        if self.executor is not None and self.executor.loop is not None:
            loops.add(self.executor.loop)
        return loops

    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[aiohttp.ClientSession]:
        """A session for the running loop: pooled on this engine's own loops (the control and
        rollout threads), a temporary one on a caller's loop (closed when the call ends)."""
        loop = asyncio.get_running_loop()
        if loop not in self._owned_loops():
            async with aiohttp.ClientSession() as session:
                yield session
            return
        session = self._sessions.get(loop)
        if session is None or session.closed:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._sessions[loop] = session
        yield session

    # ------------------------------------------------------------------------------ HTTP

    async def _post(self, url: str, body: dict[str, Any], *, admin: bool, timeout: float,
                    retries: int) -> dict[str, Any]:
        """POST JSON; retry connection errors, timeouts and 5xx (except a weights-invalid 503)."""
        async with self._client() as session:
            return await self._post_with(session, url, body, admin=admin, timeout=timeout, retries=retries)

    async def _post_with(self, session: aiohttp.ClientSession, url: str, body: dict[str, Any], *,
                         admin: bool, timeout: float, retries: int) -> dict[str, Any]:
        headers = {"Content-Type": "application/json",
                   **(auth_headers(self.config.admin_api_key) if admin else {})}
        data = json.dumps(body).encode()
        reason = "no attempt"
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(backoff_delay(attempt - 1, self.config.retry_backoff))
            try:
                async with session.post(url, data=data, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    status, raw = resp.status, await resp.read()
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                reason = f"{type(exc).__name__}: {exc or 'timed out'}"
                continue
            if status == 200:
                return json.loads(raw)
            message = error_message(raw)
            try:
                code = json.loads(raw).get("code")
            except (ValueError, AttributeError):
                code = None
            if status == 503 and code == "weights_invalid":
                raise GenerationRefused(f"{url}: {message}", status, url)
            if status < 500:
                raise ServerError(f"{url} answered {status}: {message}", status, url)
            reason = f"HTTP {status}: {message}"
        raise ServerError(f"POST {url} failed after {retries + 1} attempt(s): {reason}", None, url)

    def _all(self, route: str, body: dict[str, Any], timeout: float, retries: int = 0,
             every_rank: bool = False) -> list[dict]:
        """POST an admin route to every server concurrently (from a plain thread); with
        ``every_rank``, to ``/tp/{r}{route}`` of every TP rank of every server."""
        urls = [f"{url}/tp/{r}{route}" for url in self.addresses for r in range(self.tp_sizes[url])] \
            if every_rank else [f"{url}{route}" for url in self.addresses]
        return self._post_each([(u, body) for u in urls], timeout, retries)

    def _post_each(self, requests: list[tuple[str, dict[str, Any]]], timeout: float,
                   retries: int = 0) -> list[dict]:
        """POST each ``(url, body)`` as an admin request, concurrently (from a plain thread)."""
        if self._control is None:
            raise RuntimeError("RemoteInferenceEngine is not initialized")

        async def run() -> list[dict]:
            return list(await asyncio.gather(*[
                self._post(u, b, admin=True, timeout=timeout, retries=retries) for u, b in requests]))

        return self._control.run(run(), timeout + 5)

    def _health_all(self, timeout: float = 30.0) -> list[dict]:
        """Every server's ``/health`` answer, in address order (from a plain thread)."""
        if self._control is None:
            raise RuntimeError("RemoteInferenceEngine is not initialized")

        async def one(session: aiohttp.ClientSession, url: str) -> dict:
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    raise ServerError(f"{url}/health answered {resp.status}", resp.status, url)
                return await resp.json()

        async def run() -> list[dict]:
            async with self._client() as session:
                return list(await asyncio.gather(*[one(session, u) for u in self.addresses]))

        return self._control.run(run(), timeout + 5)

    # ------------------------------------------------------------------------------ generation

    def _next_address(self, req: LLMRequest) -> str:
        """The server for ``req`` (round robin), after checking it is one sample and that the
        engine is initialized."""
        if req.gconfig.n_samples != 1:
            raise ValueError(f"agenerate needs gconfig.n_samples == 1 (got {req.gconfig.n_samples}); "
                             "send n requests (RLVRWorkflow does) for n samples")
        if not self.addresses:
            raise RuntimeError(f"{type(self).__name__} is not initialized")
        return self.addresses[next(self._rr) % len(self.addresses)]

    async def agenerate(self, req: LLMRequest) -> LLMResponse:
        """Generate one completion of ``req``; see the module docstring."""
        g = req.gconfig
        url = self._next_address(req)
        start = time.monotonic()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        itl: list[float] = []
        ttft = float("inf")
        stop_reason = "length"
        last_token_at: float | None = None
        while len(tokens) < g.max_new_tokens:
            while not self._resumed.is_set():
                await asyncio.sleep(0.05)
            body = {"rid": req.rid, "input_ids": list(req.input_ids) + tokens, "sampling_params": {
                "max_new_tokens": g.max_new_tokens - len(tokens),
                "min_new_tokens": max(0, g.min_new_tokens - len(tokens)),
                "greedy": g.greedy, "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
                "stop_token_ids": list(g.stop_token_ids)}}
            sent = time.monotonic()
            cfg = self.config
            answer = await self._post(f"{url}/generate", body, admin=False, timeout=cfg.request_timeout,
                                      retries=cfg.request_retries)
            out = answer["outputs"][0]
            if out["output_tokens"]:
                if not tokens and out["ttft"] is not None:
                    ttft = sent - start + out["ttft"]
                elif last_token_at is not None and out["ttft"] is not None:
                    itl.append(sent + out["ttft"] - last_token_at)
                itl.extend(out["itl"])
                last_token_at = sent + out["latency"]
            tokens += out["output_tokens"]
            logprobs += out["output_logprobs"]
            versions += out["output_versions"]
            stop_reason = out["stop_reason"]
            if stop_reason != "interrupt":
                break
        else:
            stop_reason = "length"
        return LLMResponse(input_tokens=list(req.input_ids), output_tokens=tokens, output_logprobs=logprobs,
                           output_versions=versions, stop_reason=stop_reason,
                           latency=time.monotonic() - start, ttft=ttft, itl=itl)

    # ------------------------------------------------------------------------------ weights

    def update_weights(self, meta: WeightUpdateMeta) -> concurrent.futures.Future:
        """Start the receive half of an update on every server; see the module docstring."""
        if self._update_pool is None:
            raise RuntimeError("RemoteInferenceEngine is not initialized")
        timeout = self.config.request_timeout
        if meta.type == "disk":
            expected = meta.version if meta.version is not None else self._version

            def run() -> list[dict]:
                wait_for_weight_version(str(meta.path), expected, timeout)
                return self._all("/update_weights_from_disk", {"model_path": meta.path,
                                                               "version": meta.version}, timeout)
        elif meta.type == "awex":
            version = meta.version if meta.version is not None else self._version + 1

            def run() -> list[dict]:
                return self._awex_update(meta, version, timeout)
        else:
            raise ValueError(f"WeightUpdateMeta.type must be 'disk' or 'awex', got {meta.type!r}")

        def landed() -> list[dict]:
            results = run()
            if meta.version is not None:
                self._version = int(meta.version)
            return results

        return self._update_pool.submit(landed)

    def _awex_update(self, meta: WeightUpdateMeta, version: int, timeout: float) -> list[dict]:
        """The awex receive half (on the update thread): join when needed, then receive."""
        fields = (meta.pair_name, str(meta.kv_store_url), meta.nccl_master_address,
                  int(meta.nccl_master_port))
        held = all(h.get("weight_sync") is not None for h in self._health_all())
        by_controller = held and self._joined is None
        if not by_controller and (self._joined != fields or self._rejoin or not held):
            self._joined = None
            try:
                self._join_weight_sync(meta, timeout)
            except BaseException:
                with contextlib.suppress(ServerError, RuntimeError, concurrent.futures.TimeoutError):
                    self._all("/awex/teardown", {}, 60.0, every_rank=True)  # ranks whose init succeeded
                raise
            self._joined, self._rejoin = fields, False
        try:
            return self._all("/awex/update_weights", {"version": version}, timeout, every_rank=True)
        except BaseException:
            self._rejoin = self._joined is not None
            raise

    def _join_step(self, step: str, meta: WeightUpdateMeta, fn: Callable[[], Any]) -> Any:
        """One step of a join (`awex_fast.sync.run_step`): any failure becomes a
        `WeightSyncJoinError` naming the step, the pair and the KV store."""
        return run_step(step, fn, pair=meta.pair_name, kv_url=meta.kv_store_url, error=WeightSyncJoinError)

    def _engine_metas(self, timeout: float) -> tuple[list[int], list[list[ParameterMeta]]]:
        """(engine sizes, merged side-local metas per engine): every TP rank's report, validated."""
        answers = self._all("/awex/report_weight_meta", {}, timeout, every_rank=True)
        sizes = [self.tp_sizes[url] for url in self.addresses]
        labels = [f"{url} TP rank {r}" for url in self.addresses for r in range(self.tp_sizes[url])]
        metas = [read_report(a["result"], what=f"{label}: report_weight_meta")
                 for label, a in zip(labels, answers, strict=True)]
        return sizes, merge_per_engine(metas, sizes)

    def _join_weight_sync(self, meta: WeightUpdateMeta, timeout: float) -> None:
        """The controller-less join of every TP rank of every server (module docstring), by the
        steps of `awex_fast.sync.join`."""
        pair, kv_url = meta.pair_name, meta.kv_store_url
        if not kv_url:
            raise WeightSyncJoinError("WeightUpdateMeta.kv_store_url is required for an awex update when "
                                      "no controller formed the weight-sync group (see "
                                      "WeightUpdateMeta.from_awex)", step="kv_store_url", pair=pair)
        self._join_step("teardown", meta, lambda: self._all("/awex/teardown", {}, 60.0, every_rank=True))
        sizes, groups = self._join_step("report_weight_meta", meta, lambda: self._engine_metas(timeout))
        key = meta.admin_api_key if meta.admin_api_key is not None else self.config.admin_api_key
        kv = KVStoreClient(kv_url, key or "")
        try:
            def publish() -> None:
                reset_group_keys(kv, pair)
                publish_side(kv, pair, "inference", groups, sizes)

            self._join_step("publish infer_params_meta", meta, publish)
            train_sizes = self._join_step("wait for training_params_meta", meta,
                                          lambda: wait_side(kv, pair, "training", timeout)[0])
        finally:
            kv.close()
        world = World(tuple(sizes), sum(train_sizes))
        addr, port = meta.nccl_master_address, int(meta.nccl_master_port)
        requests = [(f"{url}/tp/{r}/awex/init_weights_update_group",
                     world.init_args(pair, kv_url, addr, port, world.inference_rank(e, r)))
                    for e, url in enumerate(self.addresses) for r in range(self.tp_sizes[url])]
        self._join_step("init_weight_update_group", meta, lambda: self._post_each(requests, timeout))

    def set_version(self, version: int) -> None:
        """Set the version here and on every server (tokens generated next carry it)."""
        self._all("/set_version", {"version": int(version)}, 60.0, retries=self.config.request_retries)
        self._version = int(version)

    def get_version(self) -> int:
        """This client's weight version (the staleness bound reads it)."""
        return self._version

    def pause_generation(self) -> None:
        """Interrupt generation on every server (requests in flight end with ``"interrupt"``)."""
        self._resumed.clear()
        self._all("/pause_generation", {}, 60.0)

    def continue_generation(self) -> None:
        """Let the servers generate again; interrupted requests are resubmitted."""
        self._all("/continue_generation", {}, 60.0)
        self._resumed.set()

    def pause(self) -> None:
        """Stop starting episodes and interrupt generation on every server."""
        if self.executor is not None:
            self.executor.pause()
        self.pause_generation()

    def resume(self) -> None:
        """Undo `pause`."""
        self.continue_generation()
        if self.executor is not None:
            self.executor.resume()

    # ------------------------------------------------------------------------------ rollout

    def _executor(self) -> Any:
        if self.executor is None:
            raise RuntimeError("RemoteInferenceEngine is not initialized")
        return self.executor

    def submit(self, data: dict[str, Any], workflow: RolloutWorkflow) -> None:
        """Queue one episode (see `WorkflowExecutor.submit`)."""
        self._executor().submit(data, workflow)

    def wait(self, count: int, timeout: float | None = None,
             should_accept: Callable[[TensorDict], bool] | None = None) -> TensorDict:
        """``count`` accepted trajectories (see `WorkflowExecutor.wait`)."""
        return self._executor().wait(count, timeout, should_accept)

    def rollout_batch(self, data: list[dict[str, Any]], workflow: RolloutWorkflow) -> TensorDict:
        """Submit all of ``data`` and wait for every trajectory."""
        return self._executor().rollout_batch(data, workflow)

    def prepare_batch(self, dataloader: Any, workflow: RolloutWorkflow,
                      should_accept: Callable[[TensorDict], bool] | None = None) -> TensorDict:
        """The next full batch from a continuously fed rollout queue."""
        return self._executor().prepare_batch(dataloader, workflow, should_accept)
