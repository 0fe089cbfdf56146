"""Serving an aiohttp app without owning the process, behind the connection limits every
awex_fast server needs.

`serve_app` binds ``127.0.0.1`` port 0 by default (never a hard-coded port), reports the port
the OS chose, and puts a `awex_fast.net.conn_guard.ConnectionGuard` in front of aiohttp so that
idle, half-sent and stalled connections are dropped after bounded times and open connections
stay below the process's file-descriptor limit (`ServeLimits`; why in `conn_guard`). The KV
store, the pair gateway, the worker routes and the inference server all serve through it, so all
of them get the same limits. `BackgroundServer` runs `serve_app` on a private loop thread for
synchronous callers; `serve_until_signal` is what every ``awex-fast`` server command does once
it listens.

aiohttp is used through its public pieces only: ``web.AppRunner`` (startup and cleanup hooks,
graceful shutdown), its ``.server`` (the low-level ``web.Server``, a protocol factory) and
``loop.create_server``; the guard wraps that factory instead of a ``web.TCPSite``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from awex_fast.net.conn_guard import ConnectionGuard, ServeLimits
from awex_fast.net.httputil import EventLoopThread

__all__ = ["BackgroundServer", "ServedApp", "serve_app", "serve_until_signal"]


def _connectable_host(host: str) -> str:
    """Host part of a URL others can use to reach a socket bound to ``host``."""
    if host in ("", "0.0.0.0", "::"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect(("10.255.255.255", 1))  # UDP connect sends nothing; picks the route
                host = probe.getsockname()[0]
        except OSError:
            host = "127.0.0.1"
    return f"[{host}]" if ":" in host else host


class ServedApp:
    """An aiohttp application listening inside the current event loop (see :func:`serve_app`).

    ``host``/``port``/``url`` give the real address; ``guard`` the connection limits in force;
    ``await close()`` stops listening, waits up to ``shutdown_timeout`` seconds for in-flight
    requests and runs cleanup hooks.
    """

    def __init__(self, runner: web.AppRunner, server: asyncio.AbstractServer, guard: ConnectionGuard,
                 host: str, port: int) -> None:
        """Wrap a started runner and its listening server; use :func:`serve_app` instead."""
        self.runner = runner
        self.guard = guard
        self.host = host
        self.port = port
        self.url = f"http://{_connectable_host(host)}:{port}"
        self._server: asyncio.AbstractServer | None = server

    async def close(self) -> None:
        """Stop listening, close every connection and release the runner (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await self.guard.stop()
        await self.runner.cleanup()
        # Every connection is closed by now; a bound keeps a stray transport from hanging close().
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5.0)


async def serve_app(
    app: web.Application, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout: float = 2.0,
    limits: ServeLimits | None = None, name: str = "awex-fast-http",
) -> ServedApp:
    """Start ``app`` on ``host:port`` in the running loop and return once it is listening.

    ``port=0`` asks the OS for a free port; the returned :class:`ServedApp` reports it.
    ``limits`` (default ``ServeLimits()``) bounds idle, header and body times and the number of
    open connections; ``name`` labels the guard's log lines. Startup failures (address in use,
    bad host) raise ``OSError`` after the runner is cleaned up.
    """
    limits = limits if limits is not None else ServeLimits()
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        assert runner.server is not None  # set by setup()
        guard = ConnectionGuard(runner.server, limits, name=name)
        server = await asyncio.get_running_loop().create_server(
            guard.protocol_factory, host, port, backlog=limits.effective_backlog())
    except BaseException:
        await runner.cleanup()
        raise
    guard.start()
    # One server on one host: its first socket's port is the port (same for IPv4 and IPv6).
    return ServedApp(runner, server, guard, host, int(server.sockets[0].getsockname()[1]))


class BackgroundServer:
    """Serve an aiohttp app from a private loop thread, for synchronous code and tests.

    ``start()`` returns once the socket listens (``.port``/``.url`` then give the address the OS
    chose for ``port=0``); ``stop()`` shuts it down; it is also a context manager. ``app`` is an
    ``aiohttp.web.Application`` or a zero-argument factory returning one (a factory lets one
    object be started again after ``stop()``, since an app can be run only once). ``limits``
    as in :func:`serve_app`.
    """

    def __init__(
        self,
        app: web.Application | Callable[[], web.Application],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "awex-fast-http",
        shutdown_timeout: float = 2.0,
        limits: ServeLimits | None = None,
    ) -> None:
        """Configure the server; nothing listens until :meth:`start`."""
        self._app = app
        self.host = host
        self.requested_port = port
        self.name = name
        self.shutdown_timeout = shutdown_timeout
        self.limits = limits
        self._loop_thread: EventLoopThread | None = None
        self._served: ServedApp | None = None

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and :meth:`stop`."""
        return self._served is not None

    @property
    def port(self) -> int:
        """The port the server listens on (raises before :meth:`start`)."""
        return self._require().port

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server (raises before :meth:`start`)."""
        return self._require().url

    def _require(self) -> ServedApp:
        if self._served is None:
            raise RuntimeError(f"server {self.name!r} is not running; call start() first")
        return self._served

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Bind and listen; returns ``self`` once requests are accepted. Raises ``OSError`` if
        the address cannot be bound, ``RuntimeError`` if already running."""
        if self._served is not None:
            raise RuntimeError(f"server {self.name!r} is already running at {self._served.url}")
        app = self._app if isinstance(self._app, web.Application) else self._app()
        loop_thread = EventLoopThread(name=self.name)
        try:
            self._served = loop_thread.run(
                serve_app(app, self.host, self.requested_port, shutdown_timeout=self.shutdown_timeout,
                          limits=self.limits, name=self.name),
                timeout,
            )
        except BaseException:
            loop_thread.stop()
            raise
        self._loop_thread = loop_thread
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving and join the loop thread (idempotent)."""
        served, loop_thread = self._served, self._loop_thread
        self._served = self._loop_thread = None
        if loop_thread is None:
            return
        try:
            if served is not None:
                loop_thread.run(served.close(), timeout)
        finally:
            loop_thread.stop(timeout)

    def __enter__(self) -> BackgroundServer:
        """Start the server (``with BackgroundServer(app) as srv: ...``)."""
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        """Stop the server."""
        self.stop()


async def serve_until_signal(url: str, banner: str, close: Callable[[], Awaitable[Any]]) -> int:
    """What every ``awex-fast`` server command does once it listens: print ``url`` as the first
    stdout line (so a parent that asked for port 0 learns the port), ``banner`` on stderr, wait
    for SIGINT or SIGTERM, then ``await close()``. Returns the exit code 0."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(url, flush=True)
        print(banner, file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await close()
    return 0
