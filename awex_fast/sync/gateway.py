"""The pair controller over HTTP (``awex-fast gateway``): a `WeightSyncPair` per pair name over
HTTP workers, and (optionally) the KV store's routes on the same app, as AReaL's gateway serves
both. Routes are in `gateway_app`'s docstring; each is one method of `_Gateway`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from aiohttp import web

from awex_fast.net import (
    ADMIN_KEY_ENV,
    KVStore,
    ServerSettings,
    add_kv_routes,
    add_server_arguments,
    check_bearer,
    json_error,
    json_error_middleware,
    read_json_body,
    serve_app,
    serve_until_signal,
    server_settings,
)
from awex_fast.sync.pair import PairError, WeightSyncPair
from awex_fast.sync.workers import HttpWorker, WorkerError

GATEWAY_STATE: web.AppKey[dict[str, Any]] = web.AppKey("awex_gateway_state", dict)
_SIDES = ("training", "inference")


def _pair_body(body: dict[str, Any], route: str) -> str:
    name = body.get("pair_name")
    if not isinstance(name, str) or not name:
        raise json_error(400, f"{route}: field 'pair_name' must be a non-empty string")
    return name


def _worker_urls(body: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The ``training`` and ``engines`` URL lists of a ``/connect`` body (400 when malformed)."""
    training, engines = body.get("training"), body.get("engines")
    if not (isinstance(training, list) and training and all(isinstance(u, str) for u in training)):
        raise json_error(400, "connect: 'training' must be a non-empty list of worker URLs")
    if not (
        isinstance(engines, list)
        and engines
        and all(isinstance(e, list) and e and all(isinstance(u, str) for u in e) for e in engines)
    ):
        raise json_error(400, "connect: 'engines' must be a non-empty list of non-empty lists of worker URLs")
    return training, engines


class _Gateway:
    """The gateway's state (its key, its pairs, its own URL once it listens) and its handlers."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.pairs: dict[str, WeightSyncPair] = {}
        self.state: dict[str, Any] = {"kv_store_url": None}  # filled in once the gateway listens

    async def body_of(self, request: web.Request, route: str) -> dict[str, Any]:
        check_bearer(request, self.key)
        body = await read_json_body(request, 1 << 20)
        if not isinstance(body, dict):
            raise json_error(400, f"{route}: body must be a JSON object")
        return body

    def pair_of(self, name: str) -> WeightSyncPair:
        pair = self.pairs.get(name)
        if pair is None:
            raise json_error(404, f"pair {name!r} is not connected", pair_name=name)
        return pair

    def _new_pair(self, request: web.Request, name: str, body: dict[str, Any]) -> WeightSyncPair:
        training, engines = _worker_urls(body)
        kv_url = body.get("kv_store_url") or self.state["kv_store_url"] or str(request.url.origin())
        worker_key = body.get("worker_admin_key") or self.key
        try:
            return WeightSyncPair(
                name,
                kv_url,
                [HttpWorker(u, worker_key) for u in training],
                [[HttpWorker(u, worker_key) for u in e] for e in engines],
                admin_api_key=self.key,
                colocate=bool(body.get("colocate", False)),
                master_addr=str(body.get("master_addr", "127.0.0.1")),
                master_port=int(body.get("master_port", 0)),
                timeout_s=float(body.get("timeout_s", 120.0)),
                warmup=bool(body.get("warmup", True)),
                bucket_bytes=int(body["bucket_bytes"]) if body.get("bucket_bytes") else None,
            )
        except (TypeError, ValueError) as exc:
            raise json_error(400, f"connect: {exc}") from None

    async def connect(self, request: web.Request) -> web.Response:
        body = await self.body_of(request, "connect")
        name = _pair_body(body, "connect")
        _worker_urls(body)  # a malformed body leaves an existing pair alone
        old = self.pairs.pop(name, None)
        if old is not None:
            await asyncio.to_thread(old.disconnect)
            await asyncio.to_thread(old.close)
        pair = self._new_pair(request, name, body)
        try:
            result = await asyncio.to_thread(pair.connect)
        except PairError as exc:
            await asyncio.to_thread(pair.close)
            raise json_error(500, str(exc), pair_name=name) from None
        self.pairs[name] = pair
        return web.json_response({"status": "ok", "pair_name": name, "result": result})

    async def update(self, request: web.Request) -> web.Response:
        body = await self.body_of(request, "update_weights")
        pair = self.pair_of(_pair_body(body, "update_weights"))
        version = body.get("version")
        if type(version) is not int:
            raise json_error(400, f"update_weights: 'version' must be an integer, got {version!r}")
        return web.json_response(await asyncio.to_thread(pair.update_weights, version))

    def memory(self, route: str) -> Any:
        """The handler of ``/release_memory`` or ``/resume_memory``."""

        async def handle(request: web.Request) -> web.Response:
            body = await self.body_of(request, route)
            pair = self.pair_of(_pair_body(body, route))
            side, tags = body.get("side"), body.get("tags")
            if side not in _SIDES:
                raise json_error(400, f"{route}: 'side' must be 'training' or 'inference', got {side!r}")
            try:
                result = await asyncio.to_thread(getattr(pair, route), side, tags)
            except WorkerError as exc:
                raise json_error(500, str(exc)) from None
            return web.json_response({"status": "ok", "result": result})

        return handle

    async def disconnect(self, request: web.Request) -> web.Response:
        body = await self.body_of(request, "disconnect")
        name = _pair_body(body, "disconnect")
        pair = self.pair_of(name)
        del self.pairs[name]
        result = await asyncio.to_thread(pair.disconnect)
        await asyncio.to_thread(pair.close)
        return web.json_response({"status": "ok", "result": result})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy", "pairs": sorted(self.pairs)})

    async def cleanup(self, _: web.Application) -> None:
        for pair in list(self.pairs.values()):
            await asyncio.to_thread(pair.close)


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
    gateway = _Gateway(key)
    app[GATEWAY_STATE] = gateway.state
    if serve_kv:
        add_kv_routes(app, kv_store if kv_store is not None else KVStore(), key,
                      allow_anonymous_reads=allow_anonymous_reads, max_body_bytes=max_body_bytes)
    app.router.add_post("/connect", gateway.connect)
    app.router.add_post("/update_weights", gateway.update)
    app.router.add_post("/release_memory", gateway.memory("release_memory"))
    app.router.add_post("/resume_memory", gateway.memory("resume_memory"))
    app.router.add_post("/disconnect", gateway.disconnect)
    app.router.add_get("/health", gateway.health)
    app.on_cleanup.append(gateway.cleanup)
    return app


async def _serve_gateway(app: web.Application, host: str, port: int, settings: ServerSettings) -> int:
    try:
        served = await serve_app(app, host, port, limits=settings.limits, name="awex-fast-gateway")
    except OSError as exc:
        print(f"awex-fast gateway: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    app[GATEWAY_STATE]["kv_store_url"] = served.url
    banner = f"awex-fast gateway: serving at {served.url} ({settings.describe()}); SIGINT/SIGTERM stops"
    return await serve_until_signal(served.url, banner, served.close)


def gateway_main(argv: list[str] | None = None) -> int:
    """``awex-fast gateway``: serve `gateway_app` until SIGINT/SIGTERM; returns the exit code.
    The first stdout line is the URL (``--port 0`` lets the OS choose). It takes the serving
    limits of ``awex-fast kv-server`` (`awex_fast.net.add_server_arguments`). 0 after a signal,
    1 when the address cannot be bound, 2 for bad arguments or no admin key."""
    parser = argparse.ArgumentParser(prog="awex-fast gateway",
                                     description="Weight-sync pair controller (and KV store) over HTTP.")
    parser.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                        help=f"bearer key (default ${ADMIN_KEY_ENV}; prefer the variable)")
    parser.add_argument("--no-kv-store", action="store_true", help="do not serve the KV store routes")
    parser.add_argument("--allow-anonymous-reads", action="store_true", help="KV reads without the key")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    if not args.admin_key:
        print(f"awex-fast gateway: no admin key; pass --admin-key or set {ADMIN_KEY_ENV}", file=sys.stderr)
        return 2
    try:
        settings = server_settings(args)
    except ValueError as exc:
        print(f"awex-fast gateway: {exc}", file=sys.stderr)
        return 2
    app = gateway_app(args.admin_key, kv_store=KVStore(settings.max_keys, settings.max_total_bytes),
                      serve_kv=not args.no_kv_store, allow_anonymous_reads=args.allow_anonymous_reads,
                      max_body_bytes=settings.max_body_bytes)
    return asyncio.run(_serve_gateway(app, args.host, args.port, settings))


__all__ = ["GATEWAY_STATE", "gateway_app", "gateway_main"]


if __name__ == "__main__":
    sys.exit(gateway_main())
