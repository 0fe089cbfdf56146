"""`RemotevLLMEngine`: the seed `InferenceEngine` over one or more ``vllm serve`` servers.

Why a second client engine: rollouts come from vLLM (docs/DESIGN.md, "Layers"),
and RL code written against AReaL's ``RemotevLLMEngine`` should run unchanged. This engine speaks
vLLM's own HTTP routes and reuses everything of `RemoteInferenceEngine` that is not specific to
the project's decoder server (sessions and event loops, POST with retries, the
`python_engines.workflow.WorkflowExecutor` behind ``submit`` / ``wait`` / ``rollout_batch`` /
``prepare_batch``, staleness control through ``get_version``).

What the servers need: ``VLLM_SERVER_DEV_MODE=1`` (the RL routes ``/pause``, ``/resume``,
``/is_paused``, ``/weight_info``, ``/update_weight_version``, ``/collective_rpc``,
``/reset_prefix_cache``) and ``--enable-scale-out`` (the token-in/token-out route
``/inference/v1/generate``). `initialize` checks both and names the missing one. Local mode
(``initialize(local=[vllm serve args])``) runs vLLM in this process instead
(`python_engines.inference.vllm_local`), behind the same routes.
``InferenceEngineConfig.admin_api_key`` is sent as ``Authorization: Bearer`` on every request,
which is what a server started with ``--api-key`` expects.

Contract:

- ``agenerate(req)`` (``req.gconfig.n_samples`` must be 1) posts ``/inference/v1/generate`` with
  ``token_ids`` = prompt and vLLM ``SamplingParams``: ``max_tokens`` (the remaining budget,
  capped so prompt + output fits the server's ``max_model_len``; a request with no room left ends
  with ``"length"``), ``min_tokens``, ``temperature`` (0 when ``greedy``), ``top_p``, ``top_k``,
  ``stop_token_ids``, ``logprobs=0`` (the sampled token's logprob, vLLM's default raw logprobs)
  and ``ignore_eos=True``: as on the seed server, only ``stop_token_ids`` stop a request (put the
  EOS id there to stop on it) and the stop token is kept in the output. vLLM's finish reason
  ``"stop"`` / ``"length"`` map to the same seed stop reasons; ``"abort"`` (a ``/pause`` in mode
  ``abort``) is the seed's interrupt: the client waits while it is paused, then resubmits prompt
  + output so far with the remaining budget, until ``"stop"`` or ``"length"``. ``latency`` is
  measured; vLLM's non-streaming answer carries no per-token timing, so ``ttft`` stays ``inf``
  and ``itl`` empty.
- Version tags: vLLM labels every output token with the weight version that sampled it. The
  engine core stamps each step's outputs with its current label (``/update_weight_version``,
  or ``finish_weight_update(weight_version=...)`` at the end of a weight-transfer round), and
  ``/inference/v1/generate`` returns ``choices[0].weight_versions``: contiguous spans
  ``{"version", "start", "end"}`` over output-token indexes. ``output_versions`` is built from
  those spans, so a request kept in flight across an update (pause mode ``keep``) carries the old
  version on the tokens sampled before it and the new one after. Labels are the decimal strings
  this engine (and the awex_fast trainer) set; vLLM's initial label ``"default"`` reads as 0.
  (``/v1/completions`` exposes no version, which is why this engine does not use it.)
- ``pause(mode=None)`` stops new rollout episodes and POSTs ``/pause?mode=...`` to every server:
  ``"abort"`` (the default, ``pause_mode`` of the constructor) ends requests in flight, which
  this client resubmits after `resume`; ``"wait"`` returns once they have finished; ``"keep"``
  freezes them inside vLLM, and they go on after `resume`. Requests sent while paused wait.
- ``update_weights(meta)`` returns a Future (one update at a time, in order). ``"awex"``: the
  weights come from the trainer (`awex_fast.vllm`), whose round ends with
  ``finish_weight_update(weight_version=str(version))`` on every server; the Future polls every
  server's ``/weight_info`` until it reports ``str(version)`` (``meta.version``, default this
  client's version + 1), bounded by ``request_timeout``. A server that stops answering
  (``request_retries`` + 1 refused or failed polls in a row) fails the Future with a `ServerError`
  naming its address; a slow poll is not a failure (vLLM answers ``/weight_info`` from its engine
  core, busy while a round runs there), and the servers are polled concurrently, so a busy one
  never hides a dead one. ``"disk"``: waits (up to ``request_timeout``) for the trainer's version marker in
  ``meta.path`` (`python_engines.api.wait_for_weight_version`; expected version ``meta.version``,
  default this client's), then on every server concurrently: pause in mode ``keep`` unless it is
  paused already, reload ``meta.path`` with vLLM's own loader (``/collective_rpc``
  ``reload_weights``), drop the prefix cache and preempt frozen requests so that they recompute
  their KV with the new weights (``/reset_prefix_cache?reset_running_requests=true``), label the
  new weights ``str(meta.version)`` when given, and resume if it paused. Either way, the Future's
  result is ``[{"addr": url, "weight_version": label}, ...]`` in address order and, when
  ``meta.version`` is set, this client's version becomes it.
- ``set_version(v)`` labels every server's weights ``str(v)`` and sets this client's version (the
  staleness bound of `WorkflowExecutor` reads ``get_version``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import aiohttp

from awex_fast.net import auth_headers, backoff_delay, error_message
from python_engines.api import (
    FinetuneSpec,
    LLMRequest,
    LLMResponse,
    WeightUpdateMeta,
    wait_for_weight_version,
)
from python_engines.inference.remote import InferenceEngineConfig, RemoteInferenceEngine, ServerError

if TYPE_CHECKING:
    from python_engines.inference.vllm_local import LocalvLLMServer

__all__ = ["PAUSE_MODES", "PauseMode", "RemotevLLMEngine"]

PauseMode = Literal["abort", "wait", "keep"]
#: vLLM's pause modes (``/pause?mode=``), see the module docstring.
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")

_GENERATE_ROUTE = "/inference/v1/generate"
_POLL_S = 0.05
_CONTROL_TIMEOUT_S = 60.0


def _version_of(label: str, url: str) -> int:
    """The integer weight version behind a vLLM label (``"default"``: 0)."""
    if label == "default":
        return 0
    try:
        return int(label)
    except ValueError:
        raise ValueError(f"vLLM server {url} labels its weights {label!r}, not an integer version; "
                         "set integer labels with RemotevLLMEngine.set_version") from None


def _token_versions(spans: list[dict[str, Any]] | None, n_tokens: int, url: str, fallback: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans (``fallback`` where none cover)."""
    versions = [fallback] * n_tokens
    for span in spans or []:
        v = _version_of(str(span["version"]), url)
        for i in range(int(span["start"]), min(int(span["end"]), n_tokens)):
            versions[i] = v
    return versions


class RemotevLLMEngine(RemoteInferenceEngine):
    """HTTP client engine over ``vllm serve`` servers; see the module docstring."""

    def __init__(self, config: InferenceEngineConfig, pause_mode: PauseMode = "abort") -> None:
        """Store the configuration and the default pause mode; connect in `initialize`."""
        super().__init__(config)
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"RemotevLLMEngine: pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.pause_mode: PauseMode = pause_mode
        self.model_names: dict[str, str] = {}
        self.max_model_lens: dict[str, int] = {}
        self._local: LocalvLLMServer | None = None

    # ------------------------------------------------------------------------------ lifecycle

    def initialize(self, addr: str | list[str] | None = None, ft_spec: FinetuneSpec | None = None, *,
                   local: Sequence[str] | None = None) -> None:
        """Connect to ``addr`` (a URL, a list of URLs, or None: ``config.server_addrs``); waits up
        to ``setup_timeout`` for every server's ``/health`` and checks that the generate and RL
        routes are enabled (module docstring). ``ft_spec`` is unused.

        Local mode: ``local`` (``vllm serve`` arguments, e.g. ``["--model", path,
        "--tensor-parallel-size", "2"]``, and no ``addr``) starts vLLM in this process
        (`python_engines.inference.vllm_local.LocalvLLMServer`) and serves from it; `destroy`
        stops it. ``addresses`` then holds its loopback URL, which is what a trainer's
        ``connect_engine(engine)`` sends weights to."""
        if local is not None:
            if addr is not None:
                raise ValueError("RemotevLLMEngine.initialize: pass addr or local, not both")
            from python_engines.inference.vllm_local import LocalvLLMServer

            self._local = LocalvLLMServer(local)
            addr = self._local.start(self.config.setup_timeout)
        try:
            super().initialize(addr, ft_spec)
        except BaseException:
            self.destroy()
            raise

    @property
    def local_server(self) -> LocalvLLMServer | None:
        """The in-process vLLM of local mode (its ``engine_client`` is the ``AsyncLLM``), or None."""
        return self._local

    def destroy(self) -> None:
        """Close connections, stop the rollout executor and, in local mode, the in-process vLLM."""
        super().destroy()
        if self._local is not None:
            self._local.stop()
            self._local = None

    async def _wait_healthy(self) -> None:
        """Wait for every server, then read its model, ``max_model_len`` and TP size and probe
        the routes this engine needs (called by `RemoteInferenceEngine.initialize`)."""
        deadline = time.monotonic() + self.config.setup_timeout
        async with self._client() as session:
            await asyncio.gather(*[self._wait_up(session, url, deadline) for url in self.addresses])
            for url in self.addresses:
                models = await self._get_with(session, f"{url}/v1/models")
                model = models["data"][0]
                self.model_names[url] = str(model["id"])
                self.max_model_lens[url] = int(model.get("max_model_len") or 1 << 62)
                status, raw = await self._raw(session, "POST", f"{url}{_GENERATE_ROUTE}", b"{}")
                if status != 400:  # 400: the route exists and rejected the empty body
                    raise RuntimeError(f"vLLM server {url}: {_GENERATE_ROUTE} answered {status} "
                                       f"({error_message(raw)}); start it with --enable-scale-out")
                status, raw = await self._raw(session, "GET", f"{url}/weight_info", None)
                if status != 200:
                    raise RuntimeError(f"vLLM server {url}: /weight_info answered {status} "
                                       f"({error_message(raw)}); start it with VLLM_SERVER_DEV_MODE=1")
                size = await self._get_with(session, f"{url}/get_world_size?include_dp=false")
                self.tp_sizes[url] = int(size["world_size"])

    async def _wait_up(self, session: aiohttp.ClientSession, url: str, deadline: float) -> None:
        while True:
            try:
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server {url} not healthy after {self.config.setup_timeout} s")
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------------------ HTTP

    async def _raw(self, session: aiohttp.ClientSession, method: str, url: str, data: bytes | None,
                   timeout: float = _CONTROL_TIMEOUT_S) -> tuple[int, bytes]:
        """One request; a pooled connection that the server closed meanwhile (uvicorn's keep-alive
        timeout) is retried once on a fresh one. Every control route is safe to repeat."""
        headers = {"Content-Type": "application/json", **auth_headers(self.config.admin_api_key)}
        for attempt in range(2):
            try:
                async with session.request(method, url, data=data, headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    return resp.status, await resp.read()
            except aiohttp.ServerDisconnectedError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _get_with(self, session: aiohttp.ClientSession, url: str,
                        timeout: float = _CONTROL_TIMEOUT_S) -> dict[str, Any]:
        status, raw = await self._raw(session, "GET", url, None, timeout)
        if status != 200:
            raise ServerError(f"GET {url} answered {status}: {error_message(raw)}", status, url)
        return json.loads(raw)

    async def _get(self, url: str, timeout: float = _CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """GET a JSON answer (no retries)."""
        async with self._client() as session:
            return await self._get_with(session, url, timeout)

    async def _call(self, url: str, body: dict[str, Any] | None = None,
                    timeout: float = _CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """POST a control route (no retries); an empty answer reads as ``{}``."""
        async with self._client() as session:
            status, raw = await self._raw(session, "POST", url, json.dumps(body or {}).encode(), timeout)
        if status != 200:
            raise ServerError(f"POST {url} answered {status}: {error_message(raw)}", status, url)
        return json.loads(raw) if raw.strip() else {}

    def _run(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the control loop from a plain thread."""
        if self._control is None:
            coro.close()
            raise RuntimeError("RemotevLLMEngine is not initialized")
        return self._control.run(coro, timeout + 5)

    def _each(self, fn: Any, timeout: float) -> list[Any]:
        """``fn(url)`` (a coroutine function) on every server concurrently, in address order."""
        async def run() -> list[Any]:
            return list(await asyncio.gather(*[fn(url) for url in self.addresses]))

        return self._run(run(), timeout)

    # ------------------------------------------------------------------------------ generation

    async def agenerate(self, req: LLMRequest) -> LLMResponse:
        """Generate one completion of ``req`` on the next server (round robin); see the module
        docstring."""
        g = req.gconfig
        url = self._next_address(req)
        start = time.monotonic()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        stop_reason = "length"
        attempt = 0
        while len(tokens) < g.max_new_tokens:
            while not self._resumed.is_set():
                await asyncio.sleep(0.05)
            prompt = list(req.input_ids) + tokens
            budget = min(g.max_new_tokens - len(tokens), self.max_model_lens[url] - len(prompt))
            if budget < 1:
                stop_reason = "length"
                break
            params: dict[str, Any] = {
                "max_tokens": budget,
                "min_tokens": min(budget, max(0, g.min_new_tokens - len(tokens))),
                "temperature": 0.0 if g.greedy else g.temperature,
                "top_p": g.top_p, "top_k": g.top_k,
                "stop_token_ids": [int(t) for t in g.stop_token_ids],
                "logprobs": 0, "ignore_eos": True, "detokenize": False,
            }
            body = {"request_id": f"{req.rid}-{attempt}", "token_ids": prompt, "sampling_params": params,
                    "model": self.model_names[url]}
            attempt += 1
            cfg = self.config
            answer = await self._post(f"{url}{_GENERATE_ROUTE}", body, admin=True,
                                      timeout=cfg.request_timeout, retries=cfg.request_retries)
            choice = answer["choices"][0]
            new = [int(t) for t in choice.get("token_ids") or []]
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(new):
                raise ServerError(f"{url}: {len(new)} tokens but {len(content)} logprobs", None, url)
            tokens += new
            logprobs += [float(c["logprob"]) for c in content]
            versions += _token_versions(choice.get("weight_versions"), len(new), url, self._version)
            reason = choice.get("finish_reason")
            if reason == "abort":
                stop_reason = "interrupt"
                continue
            stop_reason = "stop" if reason == "stop" else "length"
            break
        return LLMResponse(input_tokens=list(req.input_ids), output_tokens=tokens, output_logprobs=logprobs,
                           output_versions=versions, stop_reason=stop_reason,
                           latency=time.monotonic() - start)

    # ------------------------------------------------------------------------------ pause

    def pause_generation(self, mode: PauseMode | None = None) -> None:
        """``/pause?mode=...`` on every server (default mode: ``pause_mode``); module docstring."""
        mode = mode or self.pause_mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._resumed.clear()
        timeout = self.config.request_timeout if mode == "wait" else _CONTROL_TIMEOUT_S
        self._each(lambda url: self._call(f"{url}/pause?mode={mode}", timeout=timeout), timeout)

    def continue_generation(self) -> None:
        """``/resume`` on every server; requests interrupted by an ``abort`` pause are resubmitted."""
        self._each(lambda url: self._call(f"{url}/resume"), _CONTROL_TIMEOUT_S)
        self._resumed.set()

    def pause(self, mode: PauseMode | None = None) -> None:
        """Stop starting episodes and pause every server in ``mode`` (default ``pause_mode``)."""
        if self.executor is not None:
            self.executor.pause()
        self.pause_generation(mode)

    def resume(self) -> None:
        """Undo `pause`."""
        self.continue_generation()
        if self.executor is not None:
            self.executor.resume()

    def is_paused(self) -> list[bool]:
        """Every server's ``/is_paused``, in address order."""
        return [bool(a["is_paused"]) for a in self._each(lambda url: self._get(f"{url}/is_paused"),
                                                          _CONTROL_TIMEOUT_S)]

    # ------------------------------------------------------------------------------ versions

    def weight_versions(self) -> list[str]:
        """Every server's current weight label (``/weight_info``), in address order."""
        return [str(a["weight_version"]) for a in self._each(lambda url: self._get(f"{url}/weight_info"),
                                                              _CONTROL_TIMEOUT_S)]

    def set_version(self, version: int) -> None:
        """Label every server's weights ``str(version)`` and set this client's version."""
        label = str(int(version))
        self._each(lambda url: self._call(f"{url}/update_weight_version", {"new_version": label}),
                   _CONTROL_TIMEOUT_S)
        self._version = int(version)

    def get_version(self) -> int:
        """This client's weight version (the staleness bound reads it)."""
        return self._version

    # ------------------------------------------------------------------------------ weights

    def update_weights(self, meta: WeightUpdateMeta) -> concurrent.futures.Future:
        """Start the receive half of an update on every server; returns a
        ``concurrent.futures.Future`` (module docstring)."""
        if self._update_pool is None:
            raise RuntimeError("RemotevLLMEngine is not initialized")
        timeout = self.config.request_timeout
        if meta.type == "disk":
            expected = meta.version if meta.version is not None else self._version

            def run() -> list[dict[str, Any]]:
                wait_for_weight_version(str(meta.path), expected, timeout)
                return self._each(lambda url: self._reload_one(url, str(meta.path), meta.version, timeout),
                                  timeout)
        elif meta.type == "awex":
            version = meta.version if meta.version is not None else self._version + 1

            def run() -> list[dict[str, Any]]:
                return self._run(self._await_version(str(version), timeout), timeout)
        else:
            raise ValueError(f"WeightUpdateMeta.type must be 'disk' or 'awex', got {meta.type!r}")

        def landed() -> list[dict[str, Any]]:
            results = run()
            if meta.version is not None:
                self._version = int(meta.version)
            return results

        return self._update_pool.submit(landed)

    async def _reload_one(self, url: str, path: str, version: int | None, timeout: float) -> dict[str, Any]:
        """Disk update of one server (module docstring)."""
        paused = bool((await self._get(f"{url}/is_paused"))["is_paused"])
        if not paused:
            await self._call(f"{url}/pause?mode=keep")
        try:
            await self._call(f"{url}/collective_rpc",
                             {"method": "reload_weights", "kwargs": {"weights_path": path}}, timeout)
            reset = await self._call(f"{url}/reset_prefix_cache?reset_running_requests=true")
            if not reset.get("success", False):
                raise ServerError(f"vLLM server {url}: could not reset the prefix cache after loading "
                                  f"{path}", None, url)
            if version is not None:
                await self._call(f"{url}/update_weight_version", {"new_version": str(int(version))})
        finally:
            if not paused:
                await self._call(f"{url}/resume")
        return {"addr": url, "weight_version": str((await self._get(f"{url}/weight_info"))["weight_version"])}

    async def _await_version(self, label: str, timeout: float) -> list[dict[str, Any]]:
        """Wait until every server's ``/weight_info`` reports ``label`` (module docstring).

        The servers are polled concurrently: vLLM answers ``/weight_info`` from its engine core,
        which is busy for as long as a round runs there, so one server's poll may legitimately
        wait for most of the round; that must not delay noticing that another server died."""
        deadline = time.monotonic() + timeout
        polls = {url: asyncio.ensure_future(self._await_one(url, label, deadline, timeout))
                 for url in self.addresses}
        if not polls:
            return []
        try:
            done, _ = await asyncio.wait(polls.values(), return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # the first failure, if any, fails the whole wait
        finally:
            for task in polls.values():
                task.cancel()
        return [{"addr": url, "weight_version": label} for url in self.addresses]

    async def _await_one(self, url: str, label: str, deadline: float, timeout: float) -> None:
        """Poll one server until it reports ``label``. A poll may take until ``deadline`` (a
        busy engine core answers late, which is not a failure); a refused, reset or failed poll
        is, and ``request_retries`` + 1 of them in a row mean the server stopped answering."""
        failures = 0
        seen: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"weight version {label!r} not reported after {timeout:.1f} s by "
                                   f"vLLM server {url} (it last reported {seen!r})")
            try:
                answer = await self._get(f"{url}/weight_info", timeout=remaining)
            except asyncio.TimeoutError:
                continue  # the deadline check above names the server
            except (aiohttp.ClientError, ServerError) as exc:
                failures += 1
                if failures > self.config.request_retries:
                    raise ServerError(f"vLLM server {url} stopped answering while the engine waited "
                                      f"for weight version {label!r}: {type(exc).__name__}: {exc}",
                                      None, url) from exc
                await asyncio.sleep(backoff_delay(failures - 1, self.config.retry_backoff))
                continue
            failures = 0
            seen = str(answer["weight_version"])
            if seen == label:
                return
            await asyncio.sleep(_POLL_S)

