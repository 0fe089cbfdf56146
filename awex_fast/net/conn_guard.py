"""Connection limits for every awex_fast HTTP server: idle, header and body timeouts, and a cap on
open connections below the process's file-descriptor limit.

Why: aiohttp's server accepts every connection and keeps it as long as the client likes (its
keep-alive timer is an hour in 3.14; there is no header timeout and no connection cap). A client
that opens connections and sends nothing, or trickles a request head a byte at a time (slow
loris), holds one file descriptor per connection; at the process's ``RLIMIT_NOFILE`` every
``accept()`` fails with EMFILE, asyncio logs "Too many open files" on each try, and ``/health``
stops answering. Our servers face training and inference jobs directly, with no reverse proxy in
front to do this for them, so `awex_fast.net.serving.serve_app` puts a `ConnectionGuard` between
the listening socket and aiohttp's protocol:

- **Idle timeout**: a connection with no request in progress (new, or kept alive after an
  answer) that sends no byte for ``idle_timeout_s`` is closed silently, as nginx closes idle
  keep-alive connections. A client still reading a large answer counts as busy while the answer
  drains; one that stops reading for ``idle_timeout_s`` is closed.
- **Header timeout**: a request head must be complete ``header_timeout_s`` after its first byte,
  else the client gets 408 with a JSON body naming the limit and the connection closes.
- **Body timeout**: while a request body is due and the server is reading, ``idle_timeout_s``
  without a byte also ends in 408. A handler that computes (body complete) has no deadline.
- **Connection cap**: at most `ServeLimits.effective_max_connections` connections, at most the
  configured number and always ``fd_headroom`` below the soft fd limit (the backlog of
  not-yet-seen connections and everything else the process opens live in that headroom). At the
  cap a new connection evicts the connection that has been waiting longest for a request (a
  stalled or idle one), so a flood of silent connections cannot lock out ``/health``; when every
  connection is busy with a request, the new one gets 503 (JSON, ``Retry-After: 1``) and closes.

What it closes is logged as one summary line at most every 30 s, never once per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = ["ConnectionGuard", "ServeLimits"]

logger = logging.getLogger(__name__)

_REPORT_INTERVAL_S = 30.0  # at most one summary log line per guard in this many seconds


@dataclass(frozen=True)
class ServeLimits:
    """Limits `awex_fast.net.serving.serve_app` enforces on every connection (module docstring).

    ``idle_timeout_s``: seconds without a byte while no request runs, or while a body is due.
    ``header_timeout_s``: seconds from a request head's first byte to its end.
    ``max_connections``: the configured cap; `effective_max_connections` lowers it to fit the
    fd limit. ``fd_headroom``: descriptors kept free below the soft ``RLIMIT_NOFILE`` (None:
    see `effective_max_connections`). ``backlog``: the listening socket's accept queue, lowered
    for small fd limits by `effective_backlog`.
    """

    idle_timeout_s: float = 60.0
    header_timeout_s: float = 15.0
    max_connections: int = 4096
    fd_headroom: int | None = None
    backlog: int = 128

    def __post_init__(self) -> None:
        """Refuse limits that would disable a guard or could never admit a connection."""
        for name in ("idle_timeout_s", "header_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"ServeLimits.{name} must be positive seconds, got {value!r}")
        if self.max_connections < 1 or self.backlog < 1:
            raise ValueError(f"ServeLimits: max_connections ({self.max_connections}) and backlog "
                             f"({self.backlog}) must be >= 1")
        if self.fd_headroom is not None and self.fd_headroom < 0:
            raise ValueError(f"ServeLimits.fd_headroom must be >= 0, got {self.fd_headroom}")

    def _soft_fd_limit(self) -> int | None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return None if soft == resource.RLIM_INFINITY else int(soft)

    def effective_backlog(self) -> int:
        """``backlog``, lowered to ``soft RLIMIT_NOFILE // 8`` (but not below 16): asyncio accepts
        up to a backlog's worth of sockets in one go, each a descriptor before the guard sees it.
        (A shorter queue overflows sooner under a connection burst; clients then retry their
        SYN after a second.)"""
        soft = self._soft_fd_limit()
        return self.backlog if soft is None else min(self.backlog, max(16, soft // 8))

    def effective_max_connections(self) -> int:
        """``max_connections``, lowered to ``soft RLIMIT_NOFILE - headroom`` (but not below 4) so that
        open connections can never exhaust the process's file descriptors. The default headroom,
        ``max(3 * backlog + 64, soft // 4)``, covers the sockets in flight beyond the cap: one
        accepted batch waiting for its transports, one waiting for ``connection_made``, and the
        connections evicted for them, which asyncio closes one loop turn later."""
        soft = self._soft_fd_limit()
        if soft is None:
            return self.max_connections
        headroom = self.fd_headroom
        if headroom is None:
            headroom = max(3 * self.effective_backlog() + 64, soft // 4)
        return min(self.max_connections, max(4, soft - headroom))


def raw_json_answer(status: int, reason: str, payload: dict[str, Any], *, retry_after: bool = False) -> bytes:
    """A complete HTTP/1.1 answer with a JSON body and ``Connection: close``, for a connection
    that aiohttp never sees (refused) or is about to be closed under it (timed out)."""
    body = json.dumps(payload).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n")
    return (head + ("Retry-After: 1\r\n" if retry_after else "") + "\r\n").encode() + body


class _GuardedConnection(asyncio.Protocol):
    """The protocol asyncio sees: times the connection, then hands every event to aiohttp's own
    protocol (``inner``), which never learns it is wrapped."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.request: web.BaseRequest | None = None  # the request a handler is running, if any
        self.served = 0  # requests answered on this connection
        now = time.monotonic()
        self.idle_since = now  # when the connection last became free of requests
        self.head_started: float | None = None  # first byte of the next request head
        self.last_data = now
        self.write_size = 0  # bytes still buffered for the client at the last sweep
        self.write_progress = now

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit (maybe evicting a stalled connection) or refuse with 503, then hand over."""
        self.transport = transport  # type: ignore[assignment]
        if not self.guard.admit(self):
            self.guard.refuse(self.transport)
            return
        self.admitted = True
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        """Note the time (and the start of a request head), then hand the bytes over."""
        if not self.admitted:
            return
        self.last_data = time.monotonic()
        if self.request is None and self.head_started is None:
            self.head_started = self.last_data
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        """Hand over a half-close."""
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection and hand the loss over."""
        if self.admitted:
            self.admitted = False
            self.guard.forget(self)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        """Hand over flow control."""
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        """Hand over flow control."""
        if self.admitted:
            self.inner.resume_writing()

    def expired(self, now: float) -> str | None:
        """Which limit this connection is past (``"idle"``, ``"header"``, ``"body"``,
        ``"write"``), or None while it is within every limit."""
        limits, transport = self.guard.limits, self.transport
        if transport is None or transport.is_closing():
            return None
        if self.request is not None:  # a handler runs: only a body the client stopped sending
            body_due = not self.request.content.is_eof()
            if body_due and transport.is_reading() and now - self.last_data > limits.idle_timeout_s:
                return "body"
            return None
        buffered = transport.get_write_buffer_size()
        if buffered != self.write_size:  # an answer is draining (or just finished)
            self.write_size, self.write_progress = buffered, now
            if not buffered:
                self.idle_since = max(self.idle_since, now)
            return None
        if buffered:
            return "write" if now - self.write_progress > limits.idle_timeout_s else None
        if self.head_started is not None:
            return "header" if now - self.head_started > limits.header_timeout_s else None
        return "idle" if now - self.idle_since > limits.idle_timeout_s else None

    def drop(self, reason: str) -> None:
        """Close for ``reason``: 408 naming the limit for a stalled head or body, silently else."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        limits = self.guard.limits
        if reason in ("header", "body") and not transport.get_write_buffer_size():
            limit = "header_timeout_s" if reason == "header" else "idle_timeout_s"
            seconds = getattr(limits, limit)
            what = "complete request head" if reason == "header" else "request body byte"
            transport.write(raw_json_answer(408, "Request Timeout", {
                "error": f"no {what} within {seconds:g} s ({limit}); connection closed",
                "limit": limit, limit: seconds}))
            transport.close()  # flushes the short answer (the socket buffer takes it at once)
        else:
            transport.abort()


class ConnectionGuard:
    """Enforces `ServeLimits` on the connections of one aiohttp ``web.Server`` (module docstring).

    Use: ``loop.create_server(guard.protocol_factory, ...)``, then ``guard.start()`` for the
    sweeper; ``guard.stop()`` before the runner's cleanup. It wraps ``server.request_handler``
    to learn when a request head is complete and when its handler ends.
    """

    def __init__(self, server: web.Server, limits: ServeLimits, *, name: str = "awex-fast-http") -> None:
        """Wrap ``server`` (a set-up runner's ``.server``) before any connection arrives."""
        self.limits = limits
        self.name = name
        self.max_connections = limits.effective_max_connections()
        self._server = server
        self._conns: dict[asyncio.BaseTransport, _GuardedConnection] = {}  # admitted, oldest first
        self._sweeper: asyncio.Task[None] | None = None
        self._pending: Counter[str] = Counter()  # closed or refused since the last report
        self._last_report = float("-inf")
        self._handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]] = server.request_handler
        server.request_handler = self._tracked

    @property
    def open_connections(self) -> int:
        """How many admitted connections are open now."""
        return len(self._conns)

    def protocol_factory(self) -> asyncio.Protocol:
        """A protocol for one new connection (pass this method to ``loop.create_server``)."""
        return _GuardedConnection(self, self._server())

    async def _tracked(self, request: web.BaseRequest) -> web.StreamResponse:
        conn = self._conns.get(request.transport) if request.transport is not None else None
        if conn is None:
            return await self._handler(request)
        conn.request = request
        try:
            return await self._handler(request)
        finally:
            conn.request, conn.head_started = None, None
            conn.idle_since = time.monotonic()
            conn.served += 1

    def admit(self, conn: _GuardedConnection) -> bool:
        """Register ``conn``; at the cap evict the longest-waiting connection with no request
        running, or return False (refuse) when every connection is busy."""
        if len(self._conns) >= self.max_connections:
            waiting = [c for c in self._conns.values() if c.request is None]
            if not waiting:
                self._count("refused (all busy)")
                return False
            victim = min(waiting, key=lambda c: c.idle_since)
            self._conns.pop(victim.transport, None)
            victim.drop("evicted")
            self._count("evicted at the connection cap")
        self._conns[conn.transport] = conn
        return True

    def refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 naming the cap and close (the connection never reaches aiohttp)."""
        transport.write(raw_json_answer(503, "Service Unavailable", {
            "error": f"server {self.name!r} is at its limit of {self.max_connections} open connections, "
                     "all busy; retry later", "limit": "max_connections",
            "max_connections": self.max_connections}, retry_after=True))
        transport.close()

    def forget(self, conn: _GuardedConnection) -> None:
        """Drop a closed connection from the books."""
        if self._conns.get(conn.transport) is conn:
            del self._conns[conn.transport]

    def sweep(self, now: float | None = None) -> int:
        """Close every connection past a limit; returns how many were closed."""
        now = time.monotonic() if now is None else now
        closed = 0
        for transport, conn in list(self._conns.items()):
            reason = conn.expired(now)
            if reason is not None:
                self._conns.pop(transport, None)
                conn.drop(reason)
                closed += 1
                if reason != "idle" or not conn.served:  # an idle keep-alive client is no news
                    self._count(f"{reason} timeout")
        self._report(now)
        return closed

    def _count(self, what: str) -> None:
        self._pending[what] += 1
        self._report(time.monotonic())

    def _report(self, now: float) -> None:
        if not self._pending or now - self._last_report < _REPORT_INTERVAL_S:
            return
        summary = ", ".join(f"{n} {what}" for what, n in sorted(self._pending.items()))
        logger.warning("%s: closed or refused connections: %s (limits: %d connections, idle %g s, "
                       "header %g s; %d open)", self.name, summary, self.max_connections,
                       self.limits.idle_timeout_s, self.limits.header_timeout_s, len(self._conns))
        self._pending.clear()
        self._last_report = now

    def start(self) -> None:
        """Start the sweeper task on the running loop."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        # A quarter of the shortest limit keeps each deadline within 25 % of its value.
        tick = min(max(min(self.limits.idle_timeout_s, self.limits.header_timeout_s) / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(tick)
            self.sweep()

    async def stop(self) -> None:
        """Stop the sweeper (the runner's cleanup closes the connections)."""
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
