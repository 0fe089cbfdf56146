"""The KV store served over HTTP: its routes, `KVStoreServer` and the ``awex-fast kv-server`` CLI.

The routes and answers match the KV store of AReaL's weight-update gateway, so AReaL workers can
use this server and our clients (`awex_fast.net.kv_client`) can use AReaL's:

- ``GET|PUT|DELETE /weight_meta/{pair}/{key}``: body and answer ``{"value": v}``; GET of an
  unknown key is 404; PUT answers ``{"status": "ok"}``; DELETE ``{"status": "ok", "deleted": b}``.
- ``PUT /weight_meta/{pair}/set/{key}`` with ``{"value": "member"}``: idempotent set add.
- ``GET /weight_meta/{pair}/set/{key}/size`` -> ``{"size": n}`` (0 for a set never written).
- ``GET /weight_meta/{pair}/set/{key}/members`` -> ``{"members": [...]}``, sorted (empty for a set
  never written).
- ``GET /health`` -> ``{"status": "healthy"}``, no key needed.

Writes need ``Authorization: Bearer <admin key>`` (401 missing, 403 wrong; constant-time
compare); reads need it too unless the server allows anonymous reads (AReaL's workers read
without a key). Values are any JSON; bytes travel as base64 strings. Every error answer is
``{"error": "..."}``, with the limit named where one was hit: 413 for a body above
``max_body_bytes`` (``limit_bytes``) or a write past the store's ``max_keys`` /
``max_total_bytes`` (``store_full``, ``limit``), 400 for malformed bodies, and, from the
connection guard every server shares (`awex_fast.net.conn_guard`), 408 for a stalled request and
503 at the connection cap. DELETE of an absent key answers 200 with ``deleted: false`` (as AReaL
does), which keeps DELETE idempotent under client retries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from aiohttp import web

from awex_fast.net.conn_guard import ServeLimits
from awex_fast.net.httputil import check_bearer, json_error, json_error_middleware, read_json_body
from awex_fast.net.kvstore import (
    ADMIN_KEY_ENV,
    DEFAULT_MAX_KEYS,
    DEFAULT_MAX_TOTAL_BYTES,
    KVStore,
    KVStoreFull,
    json_bytes,
    resolve_admin_key,
)
from awex_fast.net.server_args import (
    DEFAULT_MAX_BODY_BYTES,
    ServerSettings,
    add_server_arguments,
    server_settings,
)
from awex_fast.net.serving import BackgroundServer, ServedApp, serve_app, serve_until_signal

__all__ = ["DEFAULT_MAX_BODY_BYTES", "KVStoreServer", "add_kv_routes", "kv_server_main"]

_OK = b'{"status":"ok"}'


def _json_answer(payload: bytes) -> web.Response:
    return web.Response(body=payload, content_type="application/json")


def _store_full(exc: KVStoreFull, what: str) -> web.HTTPException:
    return json_error(413, f"{what} refused: {exc}", store_full=True, limit=exc.limit,
                      **{exc.limit: exc.limit_value})


class _KVRoutes:
    """The handlers of the ``/weight_meta`` routes over one store (a route table, one method per
    route; `add_kv_routes` registers them)."""

    def __init__(self, store: KVStore, admin_api_key: str, allow_anonymous_reads: bool,
                 max_body_bytes: int) -> None:
        self.store = store
        self.key = admin_api_key
        self.allow_anonymous_reads = allow_anonymous_reads
        self.max_body_bytes = max_body_bytes

    def read_auth(self, request: web.Request) -> None:
        if not self.allow_anonymous_reads:
            check_bearer(request, self.key)

    @staticmethod
    def names(request: web.Request) -> tuple[str, str]:
        return request.match_info["pair"], request.match_info["key"]

    async def get_value(self, request: web.Request) -> web.Response:
        self.read_auth(request)
        pair, key = self.names(request)
        encoded = self.store.get_json(pair, key)
        if encoded is None:
            raise json_error(404, f"key {key!r} not found in pair {pair!r}", pair=pair, key=key)
        return _json_answer(b'{"value":' + encoded + b"}")

    async def put_value(self, request: web.Request) -> web.Response:
        check_bearer(request, self.key)
        pair, key = self.names(request)
        body = await read_json_body(request, self.max_body_bytes, required_fields=("value",))
        # read_json_body rejected NaN/Infinity/1e400; only a depth near the limit may remain
        try:
            encoded = json_bytes(body["value"], what=f"value for key {key!r}")
        except RecursionError:
            raise json_error(400, f"value for key {key!r} is nested too deeply") from None
        try:
            self.store.put_json(pair, key, encoded)
        except KVStoreFull as exc:
            raise _store_full(exc, f"key {key!r} of pair {pair!r}") from None
        return _json_answer(_OK)

    async def delete_value(self, request: web.Request) -> web.Response:
        check_bearer(request, self.key)
        pair, key = self.names(request)
        deleted = self.store.delete(pair, key)
        return _json_answer(b'{"status":"ok","deleted":' + (b"true" if deleted else b"false") + b"}")

    async def add_member(self, request: web.Request) -> web.Response:
        check_bearer(request, self.key)
        pair, key = self.names(request)
        body = await read_json_body(request, self.max_body_bytes, required_fields=("value",))
        member = body["value"]
        if not isinstance(member, str):
            raise json_error(400, f"set member for key {key!r} must be a JSON string, "
                                  f"got a JSON {type(member).__name__}")
        try:
            added = self.store.add_to_set(pair, key, member)
        except KVStoreFull as exc:
            raise _store_full(exc, f"set {key!r} of pair {pair!r}") from None
        return _json_answer(b'{"status":"ok","added":' + (b"true" if added else b"false") + b"}")

    async def set_size(self, request: web.Request) -> web.Response:
        self.read_auth(request)
        pair, key = self.names(request)
        return _json_answer(b'{"size":%d}' % self.store.set_size(pair, key))

    async def set_members(self, request: web.Request) -> web.Response:
        self.read_auth(request)
        pair, key = self.names(request)
        return _json_answer(json.dumps({"members": self.store.set_members(pair, key)}).encode())


def add_kv_routes(
    app: web.Application,
    store: KVStore,
    admin_api_key: str,
    *,
    allow_anonymous_reads: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> None:
    """Add the ``/weight_meta/...`` routes (see the module docstring) backed by ``store`` to
    ``app``, so a gateway can serve the KV store from its own app. ``/health`` is not added.
    Add :func:`awex_fast.net.httputil.json_error_middleware` to ``app`` for JSON 404/405 answers."""
    if not admin_api_key or not admin_api_key.strip():
        raise ValueError("add_kv_routes: admin_api_key is blank; no client could authenticate")
    if max_body_bytes <= 0:
        raise ValueError(f"add_kv_routes: max_body_bytes must be positive, got {max_body_bytes}")
    routes = _KVRoutes(store, admin_api_key, allow_anonymous_reads, max_body_bytes)
    app.router.add_get("/weight_meta/{pair}/set/{key}/size", routes.set_size)
    app.router.add_get("/weight_meta/{pair}/set/{key}/members", routes.set_members)
    app.router.add_put("/weight_meta/{pair}/set/{key}", routes.add_member)
    app.router.add_get("/weight_meta/{pair}/{key}", routes.get_value)
    app.router.add_put("/weight_meta/{pair}/{key}", routes.put_value)
    app.router.add_delete("/weight_meta/{pair}/{key}", routes.delete_value)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "healthy"})


class KVStoreServer:
    """The KV store served over HTTP (aiohttp), routes as in the module docstring.

    Synchronous use: ``start()`` serves from a private loop thread and returns once listening;
    ``.url``/``.port`` give the real address (``port=0`` lets the OS choose); ``stop()``, or
    ``with KVStoreServer(...) as srv:``. Inside a running loop: ``await astart()`` /
    ``await astop()``, or ``async with``. The store (``.store``) outlives restarts.

    ``admin_api_key`` defaults to ``$AWEX_FAST_ADMIN_KEY``; an empty or missing key is an
    error, never an open server. ``max_body_bytes`` caps request bodies (413 above it);
    ``max_keys`` and ``max_total_bytes`` cap the store it builds (413 past either; give them to
    your own ``store`` instead when passing one); ``limits`` bounds connections
    (`awex_fast.net.conn_guard.ServeLimits`, its defaults when None).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_api_key: str | None = None,
        *,
        allow_anonymous_reads: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        store: KVStore | None = None,
        max_keys: int | None = None,
        max_total_bytes: int | None = None,
        limits: ServeLimits | None = None,
    ) -> None:
        """Configure the server; nothing listens until :meth:`start` / :meth:`astart`."""
        key = resolve_admin_key(admin_api_key)
        if not key or not key.strip():  # a blank key could never authenticate (tokens are stripped)
            raise ValueError(f"KVStoreServer: a non-blank admin_api_key is required (pass it or set "
                             f"{ADMIN_KEY_ENV}), got {key!r}")
        if max_body_bytes <= 0:
            raise ValueError(f"KVStoreServer: max_body_bytes must be positive, got {max_body_bytes}")
        if store is not None and (max_keys is not None or max_total_bytes is not None):
            raise ValueError("KVStoreServer: pass max_keys/max_total_bytes to the KVStore you give as "
                             "store=, not to the server")
        self.host = host
        self.requested_port = port
        self.allow_anonymous_reads = allow_anonymous_reads
        self.max_body_bytes = max_body_bytes
        self.limits = limits if limits is not None else ServeLimits()
        self.store = store if store is not None else KVStore(
            DEFAULT_MAX_KEYS if max_keys is None else max_keys,
            DEFAULT_MAX_TOTAL_BYTES if max_total_bytes is None else max_total_bytes)
        self._admin_api_key = key
        self._background: BackgroundServer | None = None
        self._served: ServedApp | None = None

    def build_app(self) -> web.Application:
        """A fresh aiohttp app with the KV routes, ``/health`` and JSON error answers."""
        app = web.Application(middlewares=[json_error_middleware], client_max_size=self.max_body_bytes)
        add_kv_routes(app, self.store, self._admin_api_key,
                      allow_anonymous_reads=self.allow_anonymous_reads, max_body_bytes=self.max_body_bytes)
        app.router.add_get("/health", _health)
        return app

    @property
    def running(self) -> bool:
        """True while listening."""
        return self._background is not None or self._served is not None

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server (``RuntimeError`` when not running)."""
        if self._background is not None:
            return self._background.url
        if self._served is not None:
            return self._served.url
        raise RuntimeError("KVStoreServer is not running; call start() or astart() first")

    @property
    def port(self) -> int:
        """The port the server listens on (``RuntimeError`` when not running)."""
        return int(self.url.rsplit(":", 1)[1])

    def start(self, timeout: float = 30.0) -> KVStoreServer:
        """Serve from a private loop thread; returns ``self`` once listening (``OSError`` if
        the address cannot be bound, ``RuntimeError`` if already running)."""
        if self.running:
            raise RuntimeError(f"KVStoreServer is already running at {self.url}")
        background = BackgroundServer(self.build_app, self.host, self.requested_port, name="awex-fast-kv",
                                      limits=self.limits)
        background.start(timeout)
        self._background = background
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop a server started with :meth:`start` (idempotent)."""
        background, self._background = self._background, None
        if background is not None:
            background.stop(timeout)

    async def astart(self) -> KVStoreServer:
        """Serve inside the running event loop; returns ``self`` once listening."""
        if self.running:
            raise RuntimeError(f"KVStoreServer is already running at {self.url}")
        self._served = await serve_app(self.build_app(), self.host, self.requested_port,
                                       limits=self.limits, name="awex-fast-kv")
        return self

    async def astop(self) -> None:
        """Stop a server started with :meth:`astart` (idempotent)."""
        served, self._served = self._served, None
        if served is not None:
            await served.close()

    def __enter__(self) -> KVStoreServer:
        """``with KVStoreServer(...) as srv``: start in a background thread."""
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        """Stop the background server."""
        self.stop()

    async def __aenter__(self) -> KVStoreServer:
        """``async with KVStoreServer(...) as srv``: start in the running loop."""
        return await self.astart()

    async def __aexit__(self, *exc_info: object) -> None:
        """Stop the in-loop server."""
        await self.astop()


# ---------------------------------------------------------------------------------------------
# CLI: awex-fast kv-server
# ---------------------------------------------------------------------------------------------


async def _serve_until_signal(server: KVStoreServer, settings: ServerSettings) -> int:
    try:
        await server.astart()
    except OSError as exc:
        print(f"awex-fast kv-server: cannot listen on {server.host}:{server.requested_port}: {exc}",
              file=sys.stderr)
        return 1
    banner = (f"awex-fast kv-server: serving at {server.url} (anonymous reads "
              f"{'allowed' if server.allow_anonymous_reads else 'refused'}, {settings.describe()}); "
              "SIGINT/SIGTERM stops")
    return await serve_until_signal(server.url, banner, server.astop)


def _kv_server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="awex-fast kv-server",
                                     description="HTTP KV store for awex_fast weight-sync metadata.")
    parser.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                        help=f"bearer key for writes (default ${ADMIN_KEY_ENV}; prefer the variable: "
                             "command lines are visible to other users)")
    parser.add_argument("--allow-anonymous-reads", action="store_true",
                        help="let GET requests through without the key (AReaL workers read without one)")
    add_server_arguments(parser)
    return parser


def kv_server_main(argv: list[str] | None = None) -> int:
    """``awex-fast kv-server``: serve a KV store until SIGINT/SIGTERM; returns the exit code.

    The first stdout line is the server's URL (``port 0`` lets the OS choose). Exit codes: 0
    after a signal, 1 when the address cannot be bound, 2 for bad arguments or no admin key.
    Call from the main thread (signal handlers are installed there).
    """
    args = _kv_server_parser().parse_args(argv)
    if not args.admin_key:
        print(f"awex-fast kv-server: no admin key; pass --admin-key or set {ADMIN_KEY_ENV}", file=sys.stderr)
        return 2
    try:
        settings = server_settings(args)
    except ValueError as exc:
        print(f"awex-fast kv-server: {exc}", file=sys.stderr)
        return 2
    server = KVStoreServer(args.host, args.port, args.admin_key,
                           allow_anonymous_reads=args.allow_anonymous_reads,
                           max_body_bytes=settings.max_body_bytes, max_keys=settings.max_keys,
                           max_total_bytes=settings.max_total_bytes, limits=settings.limits)
    return asyncio.run(_serve_until_signal(server, settings))


if __name__ == "__main__":
    sys.exit(kv_server_main())
