"""HTTP key-value store for weight-sync metadata: server, clients and the ``kv-server`` CLI.

Why HTTP and why these routes: the training and inference sides of a weight-sync pair run in
different jobs and must exchange metadata (``training_params_meta``, ``infer_params_meta``,
plan digests, colocated handles and acks; key names in DESIGN.md) before any transfer group
exists. The routes and answers match the KV store of AReaL's weight-update gateway, so AReaL
workers can use this server and our clients can use AReaL's:

- ``GET|PUT|DELETE /weight_meta/{pair}/{key}``: body and answer ``{"value": v}``; GET of an
  unknown key is 404; PUT answers ``{"status": "ok"}``; DELETE ``{"status": "ok", "deleted": b}``.
- ``PUT /weight_meta/{pair}/set/{key}`` with ``{"value": "member"}``: idempotent set add.
- ``GET /weight_meta/{pair}/set/{key}/size`` -> ``{"size": n}`` (0 for a set never written).
- ``GET /health`` -> ``{"status": "healthy"}``, no key needed.

Writes need ``Authorization: Bearer <admin key>`` (401 missing, 403 wrong; constant-time
compare); reads need it too unless the server allows anonymous reads (AReaL's workers read
without a key). Values are any JSON; bytes travel as base64 strings (``put_bytes``/
``get_bytes``). Bodies above ``max_body_bytes`` get 413, malformed bodies 400; every error
answer is ``{"error": "..."}``. DELETE of an absent key answers 200 with ``deleted: false`` (as
AReaL does), which keeps DELETE idempotent under client retries. Values and set members live
in separate namespaces. Nothing is ever pickled: values are JSON in, JSON out.

Client threading choice: :class:`KVStoreClient` is synchronous (the adapters call it from plain
threads) and owns one private event-loop thread on which an :class:`AsyncKVStoreClient` runs.
``asyncio.run`` per call was rejected: it raises when the calling thread already runs a loop
(an aiohttp handler, a Jupyter kernel), and it would open a new connection pool per call. The
private loop works from any thread, keeps connections alive, and lets many threads share one
client. Async code should use :class:`AsyncKVStoreClient` directly rather than block its loop.

Retries: only connection errors, request timeouts and 5xx answers are retried, at most
``retries`` times with exponential backoff; 4xx answers are final (they would not change).
Every route is idempotent, so a retried request cannot apply twice.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import quote

import aiohttp
import yarl
from aiohttp import web

from awex_fast.net.httputil import (
    BackgroundServer,
    EventLoopThread,
    RetriesExhausted,
    ServedApp,
    auth_headers,
    backoff_delay,
    check_bearer,
    error_message,
    json_error,
    json_error_middleware,
    read_json_body,
    request_with_retries,
    serve_app,
    serve_until_signal,
)

__all__ = [
    "ADMIN_KEY_ENV",
    "AsyncKVStoreClient",
    "KVAuthError",
    "KVKeyError",
    "KVRequestError",
    "KVStore",
    "KVStoreClient",
    "KVStoreError",
    "KVStoreFull",
    "KVStoreServer",
    "KVTimeoutError",
    "KVUnavailableError",
    "add_kv_routes",
    "kv_server_main",
]

logger = logging.getLogger(__name__)

ADMIN_KEY_ENV = "AWEX_FAST_ADMIN_KEY"
DEFAULT_MAX_BODY_BYTES = 256 << 20
DEFAULT_MAX_KEYS = 100_000  # values and sets together, over every pair
DEFAULT_MAX_TOTAL_BYTES = 4 << 30  # encoded values, set members and key names together


class KVStoreFull(Exception):
    """A write would take the store past its key-count or total-byte cap (HTTP 413)."""


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class KVStoreError(Exception):
    """Base of every KV store client error. ``url``, ``status`` (HTTP code or None), ``pair``
    and ``key`` say which request failed; ``str()`` is the full message."""

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None,
                 pair: str | None = None, key: str | None = None) -> None:
        """Record the message and the request it belongs to."""
        super().__init__(message)
        self.message = message
        self.url = url
        self.status = status
        self.pair = pair
        self.key = key

    def __str__(self) -> str:
        """The message (overrides ``KeyError``'s quoting in :class:`KVKeyError`)."""
        return self.message


class KVKeyError(KVStoreError, KeyError):
    """The key is not in the store (HTTP 404). Also a ``KeyError``."""


class KVAuthError(KVStoreError):
    """The server refused the admin key: ``status`` 401 (missing) or 403 (wrong)."""


class KVRequestError(KVStoreError):
    """The server rejected the request itself (400 malformed, 413 too large, other 4xx)."""


class KVUnavailableError(KVStoreError, ConnectionError):
    """The server could not be reached, timed out, or answered 5xx after all retries.
    ``attempts`` counts the tries made."""

    def __init__(self, message: str, *, attempts: int, **kwargs: Any) -> None:
        """Record the message, the failed request and the number of attempts."""
        super().__init__(message, **kwargs)
        self.attempts = attempts


class KVTimeoutError(KVStoreError, TimeoutError):
    """``wait``/``wait_set_size`` gave up: the key (or set size) did not appear in time."""


# ---------------------------------------------------------------------------------------------
# Store and server
# ---------------------------------------------------------------------------------------------


def _json_bytes(value: Any, *, what: str) -> bytes:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serialisable: {exc}") from exc


class KVStore:
    """Thread-safe in-memory store: JSON values and string sets, both scoped by pair name.

    Values are kept as their JSON encoding, so a GET answers without re-encoding. Every method
    takes the lock; any number of threads (and the server's loop) may call concurrently.
    """

    def __init__(
        self, max_keys: int = DEFAULT_MAX_KEYS, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    ) -> None:
        """Create an empty store holding at most ``max_keys`` keys (values and sets) and
        ``max_total_bytes`` (encoded values plus the characters of names and members); a write past
        either raises `KVStoreFull`."""
        if max_keys < 1 or max_total_bytes < 1:
            raise ValueError(f"KVStore: max_keys ({max_keys}) and max_total_bytes ({max_total_bytes}) "
                             "must be positive")
        self.max_keys, self.max_total_bytes = int(max_keys), int(max_total_bytes)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str], bytes] = {}
        self._sets: dict[tuple[str, str], set[str]] = {}
        self._bytes = 0  # what the caps count; updated under the lock

    def _admit(self, new_key: bool, grow: int) -> None:
        """Raise `KVStoreFull` unless one more key (when ``new_key``) and ``grow`` bytes fit."""
        keys = len(self._values) + len(self._sets) + new_key
        if keys > self.max_keys:
            raise KVStoreFull(f"the store holds its limit of {self.max_keys} keys")
        if self._bytes + grow > self.max_total_bytes:
            raise KVStoreFull(f"the store would hold {self._bytes + grow} bytes, over its limit of "
                              f"{self.max_total_bytes} bytes")

    def get_json(self, pair: str, key: str) -> bytes | None:
        """The JSON encoding of the value at ``pair/key``, or None when absent."""
        with self._lock:
            return self._values.get((pair, key))

    def put_json(self, pair: str, key: str, encoded: bytes) -> None:
        """Store an already JSON-encoded value (the caller vouches that it is valid JSON);
        `KVStoreFull` when it does not fit the caps."""
        with self._lock:
            old = self._values.get((pair, key))
            size = len(pair) + len(key) + len(encoded)
            grow = size - (0 if old is None else len(pair) + len(key) + len(old))
            self._admit(old is None, grow)
            self._values[(pair, key)] = encoded
            self._bytes += grow

    def get(self, pair: str, key: str) -> Any:
        """The value at ``pair/key``; ``KeyError`` naming the key when absent."""
        encoded = self.get_json(pair, key)
        if encoded is None:
            raise KeyError(f"key {key!r} not found in pair {pair!r}")
        return json.loads(encoded)

    def put(self, pair: str, key: str, value: Any) -> None:
        """Store any JSON-serialisable ``value`` (``TypeError`` otherwise)."""
        self.put_json(pair, key, _json_bytes(value, what=f"value for key {key!r}"))

    def delete(self, pair: str, key: str) -> bool:
        """Remove the value at ``pair/key``; True if it existed. Sets are untouched."""
        with self._lock:
            old = self._values.pop((pair, key), None)
            if old is not None:
                self._bytes -= len(pair) + len(key) + len(old)
            return old is not None

    def add_to_set(self, pair: str, key: str, member: str) -> bool:
        """Add ``member`` to the set ``pair/key``; True if it was not there yet."""
        with self._lock:
            members = self._sets.get((pair, key))
            if members is not None and member in members:
                return False
            grow = len(member) + (0 if members is not None else len(pair) + len(key))
            self._admit(members is None, grow)
            self._sets.setdefault((pair, key), set()).add(member)
            self._bytes += grow
            return True

    def set_size(self, pair: str, key: str) -> int:
        """Number of members of the set ``pair/key`` (0 when it does not exist)."""
        with self._lock:
            return len(self._sets.get((pair, key), ()))

    def keys(self, pair: str) -> list[str]:
        """Sorted value keys of ``pair`` (sets not included)."""
        with self._lock:
            return sorted(k for p, k in self._values if p == pair)

    def clear_pair(self, pair: str) -> None:
        """Drop every value and set of ``pair`` (when a pair disconnects)."""
        with self._lock:
            for entry in [e for e in self._values if e[0] == pair]:
                self._bytes -= len(pair) + len(entry[1]) + len(self._values.pop(entry))
            for entry in [e for e in self._sets if e[0] == pair]:
                self._bytes -= len(pair) + len(entry[1]) + sum(map(len, self._sets.pop(entry)))


_OK = b'{"status":"ok"}'


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

    def read_auth(request: web.Request) -> None:
        if not allow_anonymous_reads:
            check_bearer(request, admin_api_key)

    def names(request: web.Request) -> tuple[str, str]:
        return request.match_info["pair"], request.match_info["key"]

    def json_answer(payload: bytes) -> web.Response:
        return web.Response(body=payload, content_type="application/json")

    async def get_value(request: web.Request) -> web.Response:
        read_auth(request)
        pair, key = names(request)
        encoded = store.get_json(pair, key)
        if encoded is None:
            raise json_error(404, f"key {key!r} not found in pair {pair!r}", pair=pair, key=key)
        return json_answer(b'{"value":' + encoded + b"}")

    async def put_value(request: web.Request) -> web.Response:
        check_bearer(request, admin_api_key)
        pair, key = names(request)
        body = await read_json_body(request, max_body_bytes, required_fields=("value",))
        # read_json_body rejected NaN/Infinity/1e400; only a depth near the limit may remain
        try:
            encoded = _json_bytes(body["value"], what=f"value for key {key!r}")
        except RecursionError:
            raise json_error(400, f"value for key {key!r} is nested too deeply") from None
        try:
            store.put_json(pair, key, encoded)
        except KVStoreFull as exc:
            raise json_error(413, f"key {key!r} of pair {pair!r} refused: {exc}", store_full=True) from None
        return json_answer(_OK)

    async def delete_value(request: web.Request) -> web.Response:
        check_bearer(request, admin_api_key)
        pair, key = names(request)
        deleted = store.delete(pair, key)
        return json_answer(b'{"status":"ok","deleted":' + (b"true" if deleted else b"false") + b"}")

    async def add_member(request: web.Request) -> web.Response:
        check_bearer(request, admin_api_key)
        pair, key = names(request)
        body = await read_json_body(request, max_body_bytes, required_fields=("value",))
        member = body["value"]
        if not isinstance(member, str):
            raise json_error(400, f"set member for key {key!r} must be a JSON string, "
                                  f"got a JSON {type(member).__name__}")
        try:
            added = store.add_to_set(pair, key, member)
        except KVStoreFull as exc:
            raise json_error(413, f"set {key!r} of pair {pair!r} refused: {exc}", store_full=True) from None
        return json_answer(b'{"status":"ok","added":' + (b"true" if added else b"false") + b"}")

    async def set_size(request: web.Request) -> web.Response:
        read_auth(request)
        pair, key = names(request)
        return json_answer(b'{"size":%d}' % store.set_size(pair, key))

    app.router.add_get("/weight_meta/{pair}/set/{key}/size", set_size)
    app.router.add_put("/weight_meta/{pair}/set/{key}", add_member)
    app.router.add_get("/weight_meta/{pair}/{key}", get_value)
    app.router.add_put("/weight_meta/{pair}/{key}", put_value)
    app.router.add_delete("/weight_meta/{pair}/{key}", delete_value)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "healthy"})


def _resolve_admin_key(admin_api_key: str | None) -> str | None:
    return os.environ.get(ADMIN_KEY_ENV) if admin_api_key is None else admin_api_key


class KVStoreServer:
    """The KV store served over HTTP (aiohttp), routes as in the module docstring.

    Synchronous use: ``start()`` serves from a private loop thread and returns once listening;
    ``.url``/``.port`` give the real address (``port=0`` lets the OS choose); ``stop()``, or
    ``with KVStoreServer(...) as srv:``. Inside a running loop: ``await astart()`` /
    ``await astop()``, or ``async with``. The store (``.store``) outlives restarts.

    ``admin_api_key`` defaults to ``$AWEX_FAST_ADMIN_KEY``; an empty or missing key is an
    error, never an open server. ``max_body_bytes`` caps request bodies (413 above it).
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
    ) -> None:
        """Configure the server; nothing listens until :meth:`start` / :meth:`astart`."""
        key = _resolve_admin_key(admin_api_key)
        if not key or not key.strip():  # a blank key could never authenticate (tokens are stripped)
            raise ValueError(f"KVStoreServer: a non-blank admin_api_key is required (pass it or set "
                             f"{ADMIN_KEY_ENV}), got {key!r}")
        if max_body_bytes <= 0:
            raise ValueError(f"KVStoreServer: max_body_bytes must be positive, got {max_body_bytes}")
        self.host = host
        self.requested_port = port
        self.allow_anonymous_reads = allow_anonymous_reads
        self.max_body_bytes = max_body_bytes
        self.store = store if store is not None else KVStore()
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
        background = BackgroundServer(self.build_app, self.host, self.requested_port, name="awex-fast-kv")
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
        self._served = await serve_app(self.build_app(), self.host, self.requested_port)
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
# Clients
# ---------------------------------------------------------------------------------------------


def _check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"KV {what} must be a non-empty string, got {value!r}")
    if "/" in value or value in (".", ".."):
        raise ValueError(f"KV {what} {value!r} must not contain '/' or be '.'/'..' "
                         "(it is one URL path segment)")
    return quote(value, safe="")


def _answer_field(answer: Any, field: str, kind: type, *, pair: str, key: str, url: str) -> Any:
    if not isinstance(answer, dict) or field not in answer or not isinstance(answer[field], kind):
        raise KVStoreError(f"answer for key {key!r} in pair {pair!r} lacks a {kind.__name__} {field!r}: "
                           f"{str(answer)[:200]}", url=url, pair=pair, key=key)
    return answer[field]


def _b64_decode(value: Any, *, pair: str, key: str, url: str) -> bytes:
    if not isinstance(value, str):
        raise KVStoreError(f"value of key {key!r} in pair {pair!r} is a JSON {type(value).__name__}, "
                           "not a base64 string", url=url, pair=pair, key=key)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise KVStoreError(f"value of key {key!r} in pair {pair!r} is not valid base64: {exc}",
                           url=url, pair=pair, key=key) from None


class AsyncKVStoreClient:
    """Async client of the KV store (any server with the same routes, e.g. AReaL's gateway).

    Use it from one event loop (its aiohttp session binds to the loop of first use); close it
    with ``await close()`` or ``async with``. Same methods, arguments and errors as
    :class:`KVStoreClient`, as coroutines. ``admin_api_key=None`` reads ``$AWEX_FAST_ADMIN_KEY``;
    pass ``""`` to send no key (anonymous reads).
    """

    def __init__(self, url: str, admin_api_key: str | None = None, timeout: float = 10.0,
                 retries: int = 3, backoff: float = 0.2) -> None:
        """Configure the client; no connection is made until the first request."""
        if timeout <= 0:
            raise ValueError(f"KV client timeout must be positive, got {timeout}")
        if retries < 0:
            raise ValueError(f"KV client retries must be >= 0, got {retries}")
        if backoff < 0:
            raise ValueError(f"KV client backoff must be >= 0, got {backoff}")
        parsed = yarl.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"KV store url must be http(s)://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._headers = auth_headers(_resolve_admin_key(admin_api_key))
        self._session: aiohttp.ClientSession | None = None

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    def retry_budget_s(self) -> float:
        """Upper bound in seconds of one call with all its retries (timeouts plus backoff)."""
        sleeps = sum(backoff_delay(i, self.backoff) for i in range(self.retries))
        return (self.retries + 1) * self.timeout + sleeps

    async def _request(
        self, method: str, path: str, body: bytes | None = None, *, pair: str | None = None,
        key: str | None = None, retries: int | None = None, timeout: float | None = None,
    ) -> Any:
        url = self.url + path
        info: dict[str, Any] = {"url": url, "pair": pair, "key": key}
        try:
            status, payload = await request_with_retries(
                self._session_now(), method, yarl.URL(url, encoded=True), data=body,
                headers={"Content-Type": "application/json"} if body is not None else None,
                timeout=self.timeout if timeout is None else timeout,
                retries=self.retries if retries is None else retries, backoff=self.backoff,
            )
        except RetriesExhausted as exc:
            raise KVUnavailableError(f"KV store at {self.url} is unavailable: {exc}", attempts=exc.attempts,
                                     status=exc.status, **info) from exc
        where = f"{method} {url}"
        if 200 <= status < 300:
            try:
                return json.loads(payload)
            except ValueError:
                raise KVStoreError(f"{where} answered {status} with a body that is not JSON: "
                                   f"{payload[:200]!r}", status=status, **info) from None
        text = error_message(payload)
        if status == 404:
            what = f"key {key!r} not found in pair {pair!r}" if key is not None else text
            raise KVKeyError(f"{what} ({where} -> 404)", status=status, **info)
        if status in (401, 403):
            raise KVAuthError(f"{where} -> {status}: {text}", status=status, **info)
        raise KVRequestError(f"{where} -> {status}: {text}", status=status, **info)

    @staticmethod
    def _path(pair: str, key: str, *, member_set: bool = False) -> str:
        p, k = _check_name(pair, "pair name"), _check_name(key, "key")
        return f"/weight_meta/{p}/set/{k}" if member_set else f"/weight_meta/{p}/{k}"

    async def get(self, pair: str, key: str) -> Any:
        """The value at ``pair/key``; :class:`KVKeyError` when absent."""
        answer = await self._request("GET", self._path(pair, key), pair=pair, key=key)
        return _answer_field(answer, "value", object, pair=pair, key=key, url=self.url)

    async def put(self, pair: str, key: str, value: Any) -> None:
        """Store any JSON-serialisable ``value`` at ``pair/key`` (``TypeError`` if it is not)."""
        body = b'{"value":' + _json_bytes(value, what=f"value for key {key!r}") + b"}"
        await self._request("PUT", self._path(pair, key), body, pair=pair, key=key)

    async def delete(self, pair: str, key: str) -> bool:
        """Remove ``pair/key``; True if it existed (an absent key is not an error)."""
        answer = await self._request("DELETE", self._path(pair, key), pair=pair, key=key)
        return bool(answer.get("deleted", True)) if isinstance(answer, dict) else True

    async def add_to_set(self, pair: str, key: str, member: str) -> None:
        """Add the string ``member`` to the set ``pair/key`` (idempotent)."""
        if not isinstance(member, str):
            raise TypeError(f"set member for key {key!r} must be a str, got {type(member).__name__}")
        body = b'{"value":' + _json_bytes(member, what="set member") + b"}"
        await self._request("PUT", self._path(pair, key, member_set=True), body, pair=pair, key=key)

    async def set_size(self, pair: str, key: str) -> int:
        """Number of members of the set ``pair/key`` (0 when it does not exist)."""
        answer = await self._request("GET", self._path(pair, key, member_set=True) + "/size",
                                     pair=pair, key=key)
        return _answer_field(answer, "size", int, pair=pair, key=key, url=self.url)

    async def put_bytes(self, pair: str, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store raw bytes at ``pair/key`` as a base64 JSON string."""
        await self.put(pair, key, base64.b64encode(bytes(data)).decode("ascii"))

    async def get_bytes(self, pair: str, key: str) -> bytes:
        """The bytes stored with :meth:`put_bytes` (``KVStoreError`` if the value is not base64)."""
        return _b64_decode(await self.get(pair, key), pair=pair, key=key, url=self.url)

    async def _poll(
        self, timeout: float, max_interval: float, what: str, pair: str, key: str,
        probe: Callable[[float], Awaitable[tuple[bool, Any]]],
    ) -> Any:
        if timeout < 0:
            raise ValueError(f"wait timeout must be >= 0, got {timeout}")
        deadline = time.monotonic() + timeout
        interval = min(0.02, max_interval)
        last = "never polled"
        while True:
            remaining = deadline - time.monotonic()
            try:
                done, result = await probe(max(min(self.timeout, remaining), 0.05))
                if done:
                    return result
                last = f"last answer: {result}"
            except KVUnavailableError as exc:  # the server may still be starting or restarting
                last = f"last error: {exc}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KVTimeoutError(f"{what} at {self.url} did not appear within {timeout:.3g} s ({last})",
                                     url=self.url, pair=pair, key=key)
            await asyncio.sleep(min(interval, remaining))
            interval = min(interval * 1.5, max_interval)

    async def wait(self, pair: str, key: str, timeout: float, *, max_interval: float = 0.5) -> Any:
        """Poll until ``pair/key`` exists and return its value; :class:`KVTimeoutError` naming
        the key after ``timeout`` seconds. Polls back off up to ``max_interval`` seconds; an
        unreachable server counts as "not yet" until the deadline; auth errors raise at once."""
        path = self._path(pair, key)

        async def probe(attempt_timeout: float) -> tuple[bool, Any]:
            try:
                answer = await self._request("GET", path, pair=pair, key=key, retries=0,
                                             timeout=attempt_timeout)
            except KVKeyError:
                return False, "404 not found"
            return True, _answer_field(answer, "value", object, pair=pair, key=key, url=self.url)

        return await self._poll(timeout, max_interval, f"key {key!r} of pair {pair!r}", pair, key, probe)

    async def wait_bytes(self, pair: str, key: str, timeout: float) -> bytes:
        """:meth:`wait` for ``pair/key``, then decode it as :meth:`get_bytes` does."""
        return _b64_decode(await self.wait(pair, key, timeout), pair=pair, key=key, url=self.url)

    async def wait_set_size(
        self, pair: str, key: str, size: int, timeout: float, *, max_interval: float = 0.5
    ) -> int:
        """Poll until the set ``pair/key`` has at least ``size`` members; return the size seen.
        :class:`KVTimeoutError` (with the last size seen) after ``timeout`` seconds."""
        path = self._path(pair, key, member_set=True) + "/size"

        async def probe(attempt_timeout: float) -> tuple[bool, Any]:
            answer = await self._request("GET", path, pair=pair, key=key, retries=0, timeout=attempt_timeout)
            seen = _answer_field(answer, "size", int, pair=pair, key=key, url=self.url)
            return seen >= size, seen if seen >= size else f"size {seen}"

        return await self._poll(timeout, max_interval, f"set {key!r} of pair {pair!r} with {size} members",
                                pair, key, probe)

    async def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer (no key needed)."""
        answer = await self._request("GET", "/health")
        return answer if isinstance(answer, dict) else {"status": answer}

    async def close(self) -> None:
        """Close the connection pool (idempotent)."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    async def __aenter__(self) -> AsyncKVStoreClient:
        """``async with AsyncKVStoreClient(url) as kv``."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the connection pool."""
        await self.close()


class KVStoreClient:
    """Synchronous KV store client, safe to share between threads.

    Each call runs an :class:`AsyncKVStoreClient` coroutine on this client's private loop
    thread (see the module docstring for why) and blocks the caller until it finishes, bounded
    by the retry budget. Close with :meth:`close` or ``with``. ``admin_api_key=None`` reads
    ``$AWEX_FAST_ADMIN_KEY``; ``""`` sends no key. Errors: :class:`KVKeyError` (404),
    :class:`KVAuthError` (401/403), :class:`KVRequestError` (other 4xx),
    :class:`KVUnavailableError` (unreachable/5xx after retries), :class:`KVTimeoutError` (wait).
    """

    def __init__(self, url: str, admin_api_key: str | None = None, timeout: float = 10.0,
                 retries: int = 3, backoff: float = 0.2) -> None:
        """Validate the settings and start the private loop thread."""
        self._async = AsyncKVStoreClient(url, admin_api_key, timeout, retries, backoff)
        self.url = self._async.url
        self._loop = EventLoopThread(name="awex-fast-kv-client")
        self._closed = False

    def _run(self, coro: Coroutine[Any, Any, Any], budget: float | None = None) -> Any:
        if self._closed:
            coro.close()
            raise RuntimeError(f"KVStoreClient for {self.url} is closed")
        # The coroutine bounds itself; the outer bound only guards against a wedged loop.
        limit = (self._async.retry_budget_s() if budget is None else budget) + 10.0
        return self._loop.run(coro, limit)

    def get(self, pair: str, key: str) -> Any:
        """The value at ``pair/key``; :class:`KVKeyError` when absent."""
        return self._run(self._async.get(pair, key))

    def put(self, pair: str, key: str, value: Any) -> None:
        """Store any JSON-serialisable ``value`` at ``pair/key``."""
        self._run(self._async.put(pair, key, value))

    def delete(self, pair: str, key: str) -> bool:
        """Remove ``pair/key``; True if it existed."""
        return self._run(self._async.delete(pair, key))

    def add_to_set(self, pair: str, key: str, member: str) -> None:
        """Add the string ``member`` to the set ``pair/key`` (idempotent)."""
        self._run(self._async.add_to_set(pair, key, member))

    def set_size(self, pair: str, key: str) -> int:
        """Number of members of the set ``pair/key`` (0 when it does not exist)."""
        return self._run(self._async.set_size(pair, key))

    def put_bytes(self, pair: str, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store raw bytes at ``pair/key`` (base64 inside the JSON value)."""
        self._run(self._async.put_bytes(pair, key, data))

    def get_bytes(self, pair: str, key: str) -> bytes:
        """The bytes stored with :meth:`put_bytes`."""
        return self._run(self._async.get_bytes(pair, key))

    def wait(self, pair: str, key: str, timeout: float, *, max_interval: float = 0.5) -> Any:
        """Block until ``pair/key`` exists and return its value; :class:`KVTimeoutError`
        naming the key after ``timeout`` seconds (see :meth:`AsyncKVStoreClient.wait`)."""
        return self._run(self._async.wait(pair, key, timeout, max_interval=max_interval),
                         budget=timeout + self._async.timeout)

    def wait_bytes(self, pair: str, key: str, timeout: float) -> bytes:
        """:meth:`wait`, then decode the base64 value to bytes."""
        return self._run(self._async.wait_bytes(pair, key, timeout), budget=timeout + self._async.timeout)

    def wait_set_size(self, pair: str, key: str, size: int, timeout: float) -> int:
        """Block until the set ``pair/key`` has at least ``size`` members; return the size."""
        return self._run(self._async.wait_set_size(pair, key, size, timeout),
                         budget=timeout + self._async.timeout)

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer."""
        return self._run(self._async.health())

    def close(self) -> None:
        """Close connections and stop the loop thread (idempotent)."""
        if self._closed:
            return
        try:
            self._run(self._async.close(), budget=5.0)
        finally:
            self._closed = True
            self._loop.stop()

    def __enter__(self) -> KVStoreClient:
        """``with KVStoreClient(url, key) as kv``."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the client."""
        self.close()


# ---------------------------------------------------------------------------------------------
# CLI: awex-fast kv-server
# ---------------------------------------------------------------------------------------------


async def _serve_until_signal(server: KVStoreServer) -> int:
    try:
        await server.astart()
    except OSError as exc:
        print(f"awex-fast kv-server: cannot listen on {server.host}:{server.requested_port}: {exc}",
              file=sys.stderr)
        return 1
    banner = (f"awex-fast kv-server: serving at {server.url} (anonymous reads "
              f"{'allowed' if server.allow_anonymous_reads else 'refused'}, body limit "
              f"{server.max_body_bytes} bytes); SIGINT/SIGTERM stops")
    return await serve_until_signal(server.url, banner, server.astop)


def kv_server_main(argv: list[str] | None = None) -> int:
    """``awex-fast kv-server``: serve a KV store until SIGINT/SIGTERM; returns the exit code.

    The first stdout line is the server's URL (``port 0`` lets the OS choose). Exit codes: 0
    after a signal, 1 when the address cannot be bound, 2 for bad arguments or no admin key.
    Call from the main thread (signal handlers are installed there).
    """
    parser = argparse.ArgumentParser(prog="awex-fast kv-server",
                                     description="HTTP KV store for awex_fast weight-sync metadata.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 lets the OS choose (default)")
    parser.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                        help=f"bearer key for writes (default ${ADMIN_KEY_ENV}; prefer the variable: "
                             "command lines are visible to other users)")
    parser.add_argument("--allow-anonymous-reads", action="store_true",
                        help="let GET requests through without the key (AReaL workers read without one)")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
                        help="request body limit in MiB (default 256); larger bodies get 413")
    args = parser.parse_args(argv)
    if not args.admin_key:
        print(f"awex-fast kv-server: no admin key; pass --admin-key or set {ADMIN_KEY_ENV}", file=sys.stderr)
        return 2
    max_body = int(args.max_body_mb * (1 << 20))
    if max_body <= 0 or not 0 <= args.port <= 65535:
        print(f"awex-fast kv-server: --max-body-mb must be > 0 (got {args.max_body_mb}) and --port in "
              f"0..65535 (got {args.port})", file=sys.stderr)
        return 2
    server = KVStoreServer(args.host, args.port, args.admin_key,
                           allow_anonymous_reads=args.allow_anonymous_reads, max_body_bytes=max_body)
    return asyncio.run(_serve_until_signal(server))


if __name__ == "__main__":
    sys.exit(kv_server_main())
