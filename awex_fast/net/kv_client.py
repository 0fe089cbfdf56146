"""Clients of the HTTP KV store: `AsyncKVStoreClient` (coroutines) and `KVStoreClient` (blocking).

They speak the routes of `awex_fast.net.kv_server`, which are AReaL's, so they work against
AReaL's gateway as well. Errors are the specific types of `awex_fast.net.kvstore`.

Threading choice: :class:`KVStoreClient` is synchronous (the adapters call it from plain
threads) and owns one private event-loop thread on which an :class:`AsyncKVStoreClient` runs.
``asyncio.run`` per call was rejected: it raises when the calling thread already runs a loop
(an aiohttp handler, a Jupyter kernel), and it would open a new connection pool per call. The
private loop works from any thread, keeps connections alive, and lets many threads share one
client. Async code should use :class:`AsyncKVStoreClient` directly rather than block its loop.

Retries: only connection errors, request timeouts and 5xx answers (a server at its connection
limit answers 503) are retried, at most ``retries`` times with exponential backoff; 4xx answers
are final (they would not change). Every route is idempotent, so a retried request cannot
apply twice.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import quote

import aiohttp
import yarl

from awex_fast.net.httputil import (
    EventLoopThread,
    RetriesExhausted,
    auth_headers,
    backoff_delay,
    error_message,
    request_with_retries,
)
from awex_fast.net.kvstore import (
    KVAuthError,
    KVKeyError,
    KVRequestError,
    KVStoreError,
    KVTimeoutError,
    KVUnavailableError,
    json_bytes,
    resolve_admin_key,
)

__all__ = ["AsyncKVStoreClient", "KVStoreClient"]


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
        self._headers = auth_headers(resolve_admin_key(admin_api_key))
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
        body = b'{"value":' + json_bytes(value, what=f"value for key {key!r}") + b"}"
        await self._request("PUT", self._path(pair, key), body, pair=pair, key=key)

    async def delete(self, pair: str, key: str) -> bool:
        """Remove ``pair/key``; True if it existed (an absent key is not an error)."""
        answer = await self._request("DELETE", self._path(pair, key), pair=pair, key=key)
        return bool(answer.get("deleted", True)) if isinstance(answer, dict) else True

    async def add_to_set(self, pair: str, key: str, member: str) -> None:
        """Add the string ``member`` to the set ``pair/key`` (idempotent)."""
        if not isinstance(member, str):
            raise TypeError(f"set member for key {key!r} must be a str, got {type(member).__name__}")
        body = b'{"value":' + json_bytes(member, what="set member") + b"}"
        await self._request("PUT", self._path(pair, key, member_set=True), body, pair=pair, key=key)

    async def set_size(self, pair: str, key: str) -> int:
        """Number of members of the set ``pair/key`` (0 when it does not exist)."""
        answer = await self._request("GET", self._path(pair, key, member_set=True) + "/size",
                                     pair=pair, key=key)
        return _answer_field(answer, "size", int, pair=pair, key=key, url=self.url)

    async def set_members(self, pair: str, key: str) -> list[str]:
        """The members of the set ``pair/key``, sorted (empty when it does not exist)."""
        answer = await self._request("GET", self._path(pair, key, member_set=True) + "/members",
                                     pair=pair, key=key)
        members = _answer_field(answer, "members", list, pair=pair, key=key, url=self.url)
        if not all(isinstance(m, str) for m in members):
            raise KVStoreError(f"{self.url}: set {key!r} of pair {pair!r} answered non-string members",
                               pair=pair, key=key, url=self.url)
        return members

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

    def set_members(self, pair: str, key: str) -> list[str]:
        """The members of the set ``pair/key``, sorted (empty when it does not exist)."""
        return self._run(self._async.set_members(pair, key))

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
