"""The ``/awex/*`` HTTP routes of a weight-sync worker, and the JSON dispatch behind them.

Why one dispatch table: a worker's adapter is driven over HTTP (`worker_routes`), over the KV
store (`awex_fast.sync.workers.serve_kv_worker`) or in process (`awex_fast.sync.pair.WeightSyncPair` with
adapter objects). All three go through `dispatch`, so arguments are checked, results shaped
and errors reported the same way, and everything that crosses a process is JSON (metadata as
base64 metas JSON, never pickle).

Routes (``POST``, JSON object body, ``{}`` or no body where nothing is needed; the two reports
also answer ``GET``), answering ``{"status": "ok", "result": ...}``:

==================================== =========================================== ========
route                                adapter call                                key
==================================== =========================================== ========
/awex/report_parallelism             parallelism_strategy                        no
/awex/report_weight_meta             get_weight_metadata() -> {"metas": base64}  no
/awex/init_weights_update_group      init_weight_update_group(**body)            bearer
/awex/update_weights                 execute_weight_update(body["version"])      bearer
/awex/batch_isend_irecv              batch_isend_irecv(**body)                   bearer
/awex/teardown                       teardown_weight_update_group()              bearer
/awex/init_colocate_weight_update    init_colocate_weight_update(**body)         bearer
/awex/execute_colocate_weight_update execute_colocate_weight_update(version)     bearer
/awex/release_memory                 release_memory(body.get("tags"))            bearer
/awex/resume_memory                  resume_memory(body.get("tags"))             bearer
==================================== =========================================== ========

A bad body is 400 naming the field; 401/403 as in `awex_fast.net.httputil.check_bearer`; an
adapter call that raises is 500 with ``{"error": "<Type>: <message>", "type": "<Type>"}``.
Adapter calls run on one thread per `worker_routes` call, in arrival order, so the event loop
keeps answering (reports, health) while an update is in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from awex_fast.meta import metas_to_b64
from awex_fast.net import ADMIN_KEY_ENV, check_bearer, json_error, json_error_middleware, read_json_body

MAX_BODY_BYTES = 16 << 20

INIT_ARGS = ("pair_name", "master_addr", "master_port", "transfer_rank", "world_size", "kv_store_url",
             "infer_world_size", "train_world_size", "num_engines")
COLOCATE_ARGS = ("pair_name", "kv_store_url", "transfer_rank", "infer_world_size", "train_world_size",
                 "num_engines", "master_port")
COLOCATE_OPTIONAL = ("admin_api_key", "timeout_s")


class WorkerCallError(ValueError):
    """A worker call's arguments are malformed (HTTP 400); names the route and the field."""


def _int_field(args: Mapping[str, Any], field: str, route: str) -> int:
    value = args.get(field)
    if type(value) is not int:
        raise WorkerCallError(f"{route}: field {field!r} must be an integer, got {value!r}")
    return value


def _pick(args: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...], route: str) -> dict:
    missing = [f for f in required if f not in args]
    if missing:
        raise WorkerCallError(f"{route}: missing field(s) {missing}")
    unknown = sorted(set(args) - set(required) - set(optional))
    if unknown:
        raise WorkerCallError(f"{route}: unknown field(s) {unknown}")
    return {k: args[k] for k in (*required, *optional) if k in args}


def _tags(args: Mapping[str, Any], route: str) -> list[str] | None:
    tags = args.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        raise WorkerCallError(f"{route}: 'tags' must be a list of strings or null, got {tags!r}")
    return tags


def _report_meta(adapter: Any, args: Mapping[str, Any]) -> dict:
    return {"metas": metas_to_b64(adapter.get_weight_metadata())}


def _init(adapter: Any, args: Mapping[str, Any]) -> Any:
    picked = _pick(args, INIT_ARGS, (), "init_weights_update_group")
    for f in ("master_port", "transfer_rank", "world_size", "infer_world_size", "train_world_size",
              "num_engines"):
        _int_field(picked, f, "init_weights_update_group")
    return adapter.init_weight_update_group(**picked)


def _init_colocate(adapter: Any, args: Mapping[str, Any]) -> Any:
    picked = _pick(args, COLOCATE_ARGS, COLOCATE_OPTIONAL, "init_colocate_weight_update")
    for f in ("master_port", "transfer_rank", "infer_world_size", "train_world_size", "num_engines"):
        _int_field(picked, f, "init_colocate_weight_update")
    return adapter.init_colocate_weight_update(**picked)


# route -> (needs the bearer key, call(adapter, args) -> JSON-able result)
ROUTES: dict[str, tuple[bool, Callable[[Any, Mapping[str, Any]], Any]]] = {
    "report_parallelism": (False, lambda a, args: dict(a.parallelism_strategy)),
    "report_weight_meta": (False, _report_meta),
    "init_weights_update_group": (True, _init),
    "update_weights": (
        True,
        lambda a, args: a.execute_weight_update(_int_field(args, "version", "update_weights")),
    ),
    "batch_isend_irecv": (True, lambda a, args: a.batch_isend_irecv(**args)),
    "teardown": (True, lambda a, args: a.teardown_weight_update_group()),
    "init_colocate_weight_update": (True, _init_colocate),
    "execute_colocate_weight_update": (
        True,
        lambda a, args: a.execute_colocate_weight_update(
            _int_field(args, "version", "execute_colocate_weight_update")
        ),
    ),
    "release_memory": (True, lambda a, args: a.release_memory(_tags(args, "release_memory"))),
    "resume_memory": (True, lambda a, args: a.resume_memory(_tags(args, "resume_memory"))),
}


def dispatch(adapter: Any, route: str, args: Mapping[str, Any]) -> Any:
    """Run the adapter call behind ``route`` with JSON ``args``; returns its JSON-able result.
    Raises `WorkerCallError` for an unknown route or malformed arguments; whatever the adapter
    raises propagates."""
    entry = ROUTES.get(route)
    if entry is None:
        raise WorkerCallError(f"unknown worker route {route!r}; known: {sorted(ROUTES)}")
    if not isinstance(args, Mapping):
        raise WorkerCallError(f"{route}: arguments must be a JSON object, got {type(args).__name__}")
    return entry[1](adapter, args)


def error_text(exc: BaseException) -> str:
    """``"<Type>: <message>"``, the error string every worker channel reports."""
    return f"{type(exc).__name__}: {exc}"


def worker_routes(adapter: Any, admin_api_key: str | None = None) -> list[web.RouteDef]:
    """The ``/awex/*`` routes (module docstring) for ``adapter``, to add to an aiohttp app:
    ``app.add_routes(worker_routes(adapter))``.

    ``admin_api_key``: the bearer key of the mutating routes; default the adapter's
    ``admin_api_key`` attribute, then ``$AWEX_FAST_ADMIN_KEY``. An empty key is refused (the
    routes would be open). Add `awex_fast.net.httputil.json_error_middleware` to the app for JSON
    404/405 answers too (`worker_app` does).
    """
    key = admin_api_key or getattr(adapter, "admin_api_key", None) or os.environ.get(ADMIN_KEY_ENV)
    if not key:
        raise ValueError(f"worker_routes: no admin key (pass admin_api_key, give the adapter one, or set "
                         f"{ADMIN_KEY_ENV}); the mutating /awex routes would be open")
    # One thread: adapter calls run one at a time, in arrival order, off the event loop.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="awex-worker")

    def handler(route: str, needs_key: bool) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.Response:
            if needs_key:
                check_bearer(request, key)
            args: Any = {}
            if request.method == "POST" and request.body_exists:
                args = await read_json_body(request, MAX_BODY_BYTES)
            if not isinstance(args, dict):
                raise json_error(400,
                                 f"{route}: body must be a JSON object, got a JSON {type(args).__name__}")
            loop = asyncio.get_running_loop()
            try:
                result = await loop.run_in_executor(pool, dispatch, adapter, route, args)
            except WorkerCallError as exc:
                raise json_error(400, str(exc)) from None
            except Exception as exc:  # noqa: BLE001 - the adapter's failure is the answer, with its type
                raise json_error(500, error_text(exc), type=type(exc).__name__) from None
            return web.json_response({"status": "ok", "result": result})

        return handle

    routes = []
    for route, (needs_key, _) in ROUTES.items():
        handle = handler(route, needs_key)
        routes.append(web.post(f"/awex/{route}", handle))
        if not needs_key:
            routes.append(web.get(f"/awex/{route}", handle))
    return routes


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "healthy"})


def worker_app(adapter: Any, admin_api_key: str | None = None) -> web.Application:
    """A ready aiohttp app for one worker: `worker_routes`, ``GET /health`` and JSON errors."""
    app = web.Application(middlewares=[json_error_middleware], client_max_size=MAX_BODY_BYTES)
    app.add_routes(worker_routes(adapter, admin_api_key))
    app.router.add_get("/health", _health)
    return app


__all__ = ["ROUTES", "WorkerCallError", "dispatch", "error_text", "worker_app", "worker_routes"]
