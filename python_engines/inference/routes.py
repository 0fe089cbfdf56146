"""HTTP routes of the inference server (TP rank 0); request and answer JSON in docs/http.md.

Every handler that touches the scheduler or the weights hands a closure to the engine loop
(`EngineLoop.call`) and awaits it, so HTTP never races a forward pass: the closure runs between
two steps. ``/health`` alone reads the loop's state directly, so it answers even mid-step.
Mutating routes check ``Authorization: Bearer <admin key>`` (`awex_fast.net.httputil.check_bearer`).
The ``/awex/*`` worker routes of every TP rank (``/tp/{r}/awex/*``) come from
`awex_fast.sync.routes` over `python_engines.inference.gang.RankProxy` objects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from typing import Any

from aiohttp import web

from awex_fast.net import check_bearer, json_error, json_error_middleware, read_json_body
from awex_fast.sync import MAX_BODY_BYTES, worker_routes
from python_engines.inference.gang import Gang, RankProxy
from python_engines.inference.loop import EngineLoop, UpdateFailed
from python_engines.inference.sampling import SamplingParams
from python_engines.inference.scheduler import Sequence

__all__ = ["build_app"]

_MAX_BODY = 64 << 20
#: ``code`` of the 503 answer while weights are invalid (after a failed update).
WEIGHTS_INVALID = "weights_invalid"


class _WeightsInvalid(RuntimeError):
    pass


def _int_list(value: Any, what: str, upper: int | None = None) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise json_error(400, f"{what} must be a list of integers")
    if upper is not None:
        bad = [v for v in value if not 0 <= v < upper]
        if bad:
            raise json_error(400, f"{what} has token id(s) {bad[:5]} outside [0, {upper})")
    return value


class _InferenceRoutes:
    """The handlers of the main routes, over one engine loop; each hands its work to the loop."""

    def __init__(self, engine: EngineLoop, admin_key: str) -> None:
        self.engine = engine
        self.admin_key = admin_key
        self.vocab = engine.worker.args.vocab_size
        self.tp_size = engine.worker.tp_size

    async def on_loop(self, fn: Any) -> Any:
        """Run ``fn`` on the engine loop between two steps and await its result."""
        return await asyncio.wrap_future(self.engine.call(fn))

    def auth(self, request: web.Request) -> None:
        """Refuse a mutating request without the admin key (401)."""
        check_bearer(request, self.admin_key)

    async def generate(self, request: web.Request) -> web.Response:
        body = await read_json_body(request, _MAX_BODY, required_fields=["input_ids"])
        prompt = _int_list(body["input_ids"], "input_ids", self.vocab)
        raw = dict(body.get("sampling_params") or {})
        n = raw.pop("n_samples", 1)
        if not isinstance(n, int) or n < 1:
            raise json_error(400, f"sampling_params.n_samples must be an integer >= 1, got {n!r}")
        try:
            params = [SamplingParams.from_json(raw) for _ in range(n)]
        except (TypeError, ValueError) as exc:
            raise json_error(400, f"bad sampling_params: {exc}") from None
        rid = str(body.get("rid") or uuid.uuid4())
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in range(n)]
        seqs = [Sequence(rid, list(prompt), p, on_finish=lambda s, f=f: f.set_result(s))
                for p, f in zip(params, futures, strict=True)]

        def add() -> None:
            refusal = self.engine.refusal()
            if refusal is not None:
                raise _WeightsInvalid(refusal)
            for s in seqs:
                self.engine.scheduler.add(s)

        try:
            await self.on_loop(add)
        except _WeightsInvalid as exc:
            raise json_error(503, f"generation refused: {exc}", code=WEIGHTS_INVALID) from None
        except ValueError as exc:
            raise json_error(400, str(exc)) from None
        try:
            done = [await asyncio.wrap_future(f) for f in futures]
        except asyncio.CancelledError:
            self.engine.call(lambda: self.engine.scheduler.abort(rid))
            raise
        errors = [s.error for s in done if s.stop_reason == "error"]
        if errors:
            raise json_error(503, f"generation failed: {errors[0]}", code=WEIGHTS_INVALID)
        return web.json_response({"rid": rid, "input_tokens": prompt, "outputs": [s.to_json() for s in done]})

    async def pause(self, request: web.Request) -> web.Response:
        self.auth(request)

        def run() -> int:
            self.engine.scheduler.paused = True
            return self.engine.scheduler.interrupt_all()

        return web.json_response({"success": True, "interrupted": await self.on_loop(run)})

    async def resume(self, request: web.Request) -> web.Response:
        self.auth(request)

        def run() -> None:
            self.engine.scheduler.paused = False

        await self.on_loop(run)
        return web.json_response({"success": True})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        self.auth(request)
        body = await read_json_body(request, _MAX_BODY, required_fields=["model_path"])
        path, version = body["model_path"], body.get("version")
        if not isinstance(path, str) or not path:
            raise json_error(400, "model_path must be a non-empty string")
        if version is not None and not isinstance(version, int):
            raise json_error(400, f"version must be an integer or null, got {version!r}")
        try:
            op, what = {"op": "load_disk", "path": path}, f"weight update from disk {path}"
            result = await self.on_loop(lambda: self.engine.run_update(op, version, what))
        except UpdateFailed as exc:
            raise json_error(500, str(exc), success=False) from None
        return web.json_response(result)

    async def set_version(self, request: web.Request) -> web.Response:
        self.auth(request)
        body = await read_json_body(request, 1 << 16, required_fields=["version"])
        version = body["version"]
        if not isinstance(version, int) or isinstance(version, bool):
            raise json_error(400, f"version must be an integer, got {version!r}")

        def run() -> None:
            self.engine.version = version

        await self.on_loop(run)
        return web.json_response({"success": True, "version": version})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": self.engine.version, "tp_size": self.tp_size,
                                  "weights_valid": self.engine.refusal() is None,
                                  "weight_sync": self.engine.weight_sync,
                                  "awex_workers": [f"/tp/{r}" for r in range(self.tp_size)]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.json_response(await self.on_loop(self.engine.metrics))


def build_app(engine: EngineLoop, admin_key: str) -> web.Application:
    """The aiohttp application serving ``engine``; ``admin_key`` guards mutating routes."""
    if not admin_key:
        raise ValueError("build_app: admin_key is empty; the server needs a key for mutating routes")
    routes = _InferenceRoutes(engine, admin_key)
    app = web.Application(middlewares=[json_error_middleware], client_max_size=_MAX_BODY)
    app.add_routes([
        web.post("/generate", routes.generate),
        web.post("/pause_generation", routes.pause),
        web.post("/continue_generation", routes.resume),
        web.post("/update_weights_from_disk", routes.update_from_disk),
        web.post("/set_version", routes.set_version),
        web.get("/health", routes.health),
        web.get("/metrics", routes.metrics),
    ])
    _add_worker_routes(app, engine, admin_key)
    return app


def _add_worker_routes(app: web.Application, engine: EngineLoop, admin_key: str) -> None:
    """The ``/awex/*`` worker routes of every TP rank under ``/tp/{r}/``, rank 0's also at the root."""
    tp_size = engine.worker.tp_size
    cfg = engine.config
    gang = Gang(engine, tp_size, cfg.gang_timeout_s, cfg.transfer_timeout_s + cfg.gang_timeout_s + 30)
    proxies = [RankProxy(gang, r, tp_size, admin_key) for r in range(tp_size)]
    for r, proxy in enumerate(proxies):
        sub = web.Application(middlewares=[json_error_middleware], client_max_size=MAX_BODY_BYTES)
        sub.add_routes(worker_routes(proxy, admin_key))
        app.add_subapp(f"/tp/{r}/", sub)
    app.add_routes(worker_routes(proxies[0], admin_key))  # /awex/*: TP rank 0 (alias of /tp/0/awex/*)
