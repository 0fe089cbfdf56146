"""Small aiohttp helpers shared by every HTTP surface of awex_fast.

Why this module exists: the KV store, the worker routes, the pair gateway and the inference
server all speak HTTP, and docs/DESIGN.md ("House rules") fixes aiohttp as the only web stack
(the GPU image has no other). They need the same few things, and getting each one subtly wrong
in four places is how security and hang bugs happen:

- **Bearer auth** with a constant-time compare (:func:`check_bearer`): 401 when the header is
  missing or malformed, 403 when the key is wrong, each with a JSON ``{"error": ...}`` body.
- **Bounded JSON bodies** (:func:`read_json_body`): 413 from ``Content-Length`` before a byte
  is read, and again while streaming a body that did not announce its length; 400 for
  malformed JSON, non-finite numbers, or missing fields, naming what was wrong.
- **JSON errors everywhere** (:func:`json_error`, :func:`json_error_middleware`): aiohttp's own
  404/405 and unexpected handler exceptions become ``{"error": ...}`` too, so clients parse one
  shape.
- **Client retries** (:func:`request_with_retries`): connection errors, timeouts and 5xx are
  retried a bounded number of times with exponential backoff; 4xx answers never are (asking
  again would not change them). :class:`RetriesExhausted` says what failed, how often, for how
  long. :func:`error_message` pulls the ``error`` text out of an answer.
- **Calling async code from plain threads** (:class:`EventLoopThread`): one private loop per
  owner, with bounded waits and a guard against the self-deadlock of waiting on one's own loop.

Serving an app (port 0, connection limits, background threads) is `awex_fast.net.serving`.
Nothing here serialises Python objects other than through ``json``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

__all__ = [
    "EventLoopThread",
    "RetriesExhausted",
    "auth_headers",
    "backoff_delay",
    "check_bearer",
    "error_message",
    "json_error",
    "json_error_middleware",
    "read_json_body",
    "request_with_retries",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_JSON_CT = "application/json"


_ERROR_CLASSES: dict[int, type[web.HTTPError]] = {}


def _error_class(status: int) -> type[web.HTTPError]:
    # aiohttp's own per-status classes differ in constructor arguments (413 wants sizes, 405
    # wants methods), so json_error uses one plain subclass per status instead.
    cls = _ERROR_CLASSES.get(status)
    if cls is None:
        made = type(f"JSONHTTPError{status}", (web.HTTPError,), {"status_code": status})
        cls = _ERROR_CLASSES.setdefault(status, made)  # benign race between server threads
    return cls


def json_error(
    status: int, message: str, *, headers: Mapping[str, str] | None = None, **extra: Any
) -> web.HTTPException:
    """Build (not raise) an aiohttp HTTP exception whose body is ``{"error": message, **extra}``.

    ``status`` must be a 4xx or 5xx code. Raise the result from a handler:
    ``raise json_error(400, "field 'value' is missing")``.
    """
    if not 400 <= status <= 599:
        raise ValueError(f"json_error: status {status} is not a 4xx/5xx code")
    body = json.dumps({"error": message, **extra})
    return _error_class(status)(text=body, content_type=_JSON_CT, headers=dict(headers) if headers else None)


@web.middleware
async def json_error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp middleware: every 4xx/5xx answer carries a JSON ``{"error": ...}`` body.

    aiohttp's own errors (unknown route 404, 405 with its ``Allow`` header) are rewritten; our
    :func:`json_error` answers pass through; an unexpected exception is logged with its
    traceback and answered 500 naming its type and message (never the traceback).
    """
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or (exc.content_type or "").startswith(_JSON_CT):
            raise
        kept = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
        raise json_error(exc.status, f"{exc.reason}: {request.method} {request.path}", headers=kept) from None
    except Exception as exc:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        raise json_error(500, f"internal error in {request.method} {request.path}: "
                              f"{type(exc).__name__}: {exc}") from exc


def auth_headers(admin_api_key: str | None) -> dict[str, str]:
    """Headers that authenticate a request with ``admin_api_key`` (empty dict when None/empty)."""
    return {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}


def _key_bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def check_bearer(request: web.Request, expected_key: str) -> None:
    """Raise unless ``request`` carries ``Authorization: Bearer <expected_key>``.

    401 (with ``WWW-Authenticate: Bearer``) when the header is missing or is not a bearer
    token, 403 when the token is wrong. The token is compared with ``hmac.compare_digest``.
    ``expected_key`` must be non-empty: an empty key would make every request authorised.
    """
    if not expected_key or not expected_key.strip():
        raise ValueError("check_bearer: expected_key is blank; refusing to authorise every request")
    challenge = {"WWW-Authenticate": 'Bearer realm="awex_fast"'}
    header = request.headers.get("Authorization")
    if header is None or not header.strip():
        raise json_error(401, "missing Authorization header; expected 'Authorization: Bearer <admin key>'",
                         headers=challenge)
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise json_error(401, f"Authorization header uses scheme {scheme!r} without a token; "
                              "expected 'Bearer <admin key>'", headers=challenge)
    if not hmac.compare_digest(_key_bytes(token), _key_bytes(expected_key)):
        raise json_error(403, "admin key rejected: the bearer token does not match this server's key")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf, which no JSON answer can carry
        raise ValueError(f"number {text[:40]} is out of the float64 range")
    return value


async def read_json_body(
    request: web.Request, max_bytes: int, *, required_fields: Iterable[str] = ()
) -> Any:
    """Read and parse the request's JSON body, at most ``max_bytes`` bytes.

    413 when ``Content-Length`` exceeds the cap (before reading) or when a body without a
    declared length grows past it while streaming. 400 for an empty body, bytes that are not
    JSON (the decoder's message says where), ``NaN``/``Infinity``, or, when ``required_fields``
    is given, a body that is not a JSON object holding every one of them.
    """
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise json_error(413, f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes",
                         limit_bytes=max_bytes)
    buf = bytearray()
    try:
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > max_bytes:
                raise json_error(413, f"request body exceeds the limit of {max_bytes} bytes "
                                      f"(read {len(buf)} bytes so far)", limit_bytes=max_bytes)
    except (ConnectionError, aiohttp.ClientPayloadError) as exc:
        # The client went away mid-body: one short line, no traceback (nothing is wrong here);
        # the 400 answer finds no one to read it, which aiohttp ignores quietly.
        logger.info("client %s left during the body of %s %s after %d bytes (%s)",
                    request.remote, request.method, request.path, len(buf), type(exc).__name__)
        raise json_error(400, f"client left during the request body: {exc}") from None
    if not buf:
        raise json_error(400, "empty request body; expected a JSON document")
    try:
        body = json.loads(buf, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise json_error(400, f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise json_error(400, "malformed JSON body: nested too deeply") from None
    fields = list(required_fields)
    if fields:
        if not isinstance(body, dict):
            raise json_error(400, f"body must be a JSON object with field(s) {fields}, "
                                  f"got a JSON {type(body).__name__}")
        missing = [f for f in fields if f not in body]
        if missing:
            raise json_error(400, f"body is missing required field(s) {missing}; "
                                  f"it has {sorted(body)[:8]}")
    return body


class RetriesExhausted(ConnectionError):
    """A request kept failing with retryable errors. ``attempts`` tries were made over
    ``elapsed_s`` seconds; ``status`` is the last 5xx code (None after connection errors or
    timeouts); ``reason`` describes the last failure."""

    def __init__(self, message: str, *, attempts: int, elapsed_s: float, status: int | None,
                 reason: str) -> None:
        """Record the message and what the attempts saw."""
        super().__init__(message)
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.status = status
        self.reason = reason


def backoff_delay(attempt: int, backoff: float, cap: float = 5.0) -> float:
    """Seconds to sleep before retry number ``attempt + 1``: ``backoff * 2**attempt``, capped."""
    return min(backoff * (2**attempt), cap)


def error_message(body: bytes) -> str:
    """The ``error`` (or FastAPI-style ``detail``) text of a JSON error answer, else the start
    of the body as text."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        return payload["error"]
    if isinstance(payload, dict) and "detail" in payload:
        return str(payload["detail"])
    return body[:300].decode("utf-8", "replace") or "(empty body)"


async def request_with_retries(
    session: aiohttp.ClientSession,
    method: str,
    url: str | Any,
    *,
    data: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float,
    retries: int,
    backoff: float,
) -> tuple[int, bytes]:
    """Send one request and return ``(status, body)`` of the first answer below 500.

    Connection errors, timeouts (``timeout`` seconds per attempt) and 5xx answers are retried
    up to ``retries`` times, sleeping :func:`backoff_delay` between tries; then
    :class:`RetriesExhausted` is raised. 4xx answers are returned, never retried. Use it only
    for idempotent requests. ``url`` may be a ``yarl.URL`` (e.g. with ``encoded=True``).
    """
    attempts = retries + 1
    started = time.monotonic()
    reason, status = "no attempt made", None
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(backoff_delay(attempt - 1, backoff))
        try:
            async with session.request(method, url, data=data, headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                status, body = resp.status, await resp.read()
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            reason, status = f"{type(exc).__name__}: {str(exc) or f'no answer within {timeout:.3g} s'}", None
        else:
            if status < 500:
                return status, body
            reason = f"HTTP {status}: {error_message(body)}"
        if attempt + 1 < attempts:
            logger.warning("%s %s failed (%s); retry %d of %d", method, url, reason, attempt + 1, retries)
    elapsed = time.monotonic() - started
    raise RetriesExhausted(f"{method} {url} failed after {attempts} attempt(s) over {elapsed:.2f} s: "
                           f"{reason}", attempts=attempts, elapsed_s=elapsed, status=status, reason=reason)


class EventLoopThread:
    """A private asyncio event loop on a daemon thread; run coroutines on it from any thread.

    Use it to give synchronous callers (plain threads, or threads that already run their own
    loop) an async library without ``asyncio.run`` per call, which fails inside a running loop
    and throws away connection pools. :meth:`run` blocks the calling thread, never the private
    loop; calling it from the loop's own thread raises instead of deadlocking.
    """

    def __init__(self, name: str = "awex-fast-loop") -> None:
        """Start the thread and its loop; returns once the loop is running."""
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(30.0):
            raise RuntimeError(f"EventLoopThread {name!r}: loop did not start within 30 s")

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The private loop (for ``call_soon_threadsafe``); raises once stopped."""
        if self._loop is None or self._loop.is_closed() or not self._thread.is_alive():
            raise RuntimeError(f"EventLoopThread {self.name!r} is stopped")
        return self._loop

    def in_loop_thread(self) -> bool:
        """True when called from the private loop's own thread."""
        return threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the private loop and return its result (or raise its exception).

        ``timeout`` bounds the wait in seconds (None: unbounded; prefer a bound); on expiry
        the coroutine is cancelled and ``TimeoutError`` is raised.
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(f"EventLoopThread {self.name!r}: run() called from its own loop "
                               "thread would deadlock; await the coroutine instead")
        try:
            loop = self.loop
        except RuntimeError:
            coro.close()
            raise
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            # Since Python 3.11 this is also the builtin TimeoutError, so it may be the
            # coroutine's own exception: only a future still pending means our wait expired.
            if not future.done():
                future.cancel()
                raise TimeoutError(f"EventLoopThread {self.name!r}: call did not finish within "
                                   f"{timeout} s and was cancelled") from None
        return future.result()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what still runs on the loop, stop it and join the thread (idempotent)."""
        loop = self._loop
        if loop is not None and not loop.is_closed() and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                loop.call_soon_threadsafe(loop.stop)
        if not self.in_loop_thread():
            self._thread.join(timeout)
