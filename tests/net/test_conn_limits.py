"""Connection limits of every awex_fast server (`awex_fast.net.conn_guard` behind `serve_app`),
and the KV store's key and byte caps as server arguments and ``kv-server`` options.

Real servers on 127.0.0.1, real sockets: a ``kv-server`` subprocess under a 256- or 1,024-descriptor
limit flooded with more silent and half-sent connections than it has descriptors must keep answering
``/health`` at once, stay below its limit (counted in ``/proc/<pid>/fd``), close the stalled
sockets after its idle and header timeouts, and log a few lines at most. In-process servers
check each limit alone: a slow-loris head (408 after the header timeout), a stalled body (408
after the idle timeout), a silent connection (closed), a slow handler (not cut), the cap with
every connection busy (503) and with idle ones (the oldest is evicted). A real ``gateway``
process takes the same limit options as ``kv-server`` and enforces them.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from aiohttp import web

from awex_fast.net import (
    BackgroundServer,
    KVRequestError,
    KVStoreClient,
    KVStoreServer,
    ServeLimits,
    json_error_middleware,
    kv_server_main,
)

KEY = "limits-admin-key"
REPO = Path(__file__).resolve().parents[2]


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _get(url: str, path: str, timeout: float = 5.0) -> tuple[int, dict, float]:
    """One GET on a fresh connection: (status, JSON body, seconds taken)."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(*_host_port(url), timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read()), time.monotonic() - started
    finally:
        conn.close()


def _connect(url: str, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(_host_port(url), timeout=timeout)


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float | None]:
    """Everything the server sends until it closes: (bytes, seconds until closed or None)."""
    started, data = time.monotonic(), b""
    sock.setblocking(False)
    while (left := timeout - (time.monotonic() - started)) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data, time.monotonic() - started
        if not chunk:
            return data, time.monotonic() - started
        data += chunk
    return data, None


def _answer(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _closed_now(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        while chunk := sock.recv(65536):  # a 408 may come before the close
            del chunk
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


# --- the flood, against a kv-server with few descriptors ---------------------------------------------


CHILD = """
import resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
from awex_fast.net import kv_server_main
sys.exit(kv_server_main(sys.argv[2:]))
"""


@pytest.fixture(params=[(256, 400), (1024, 1100)], ids=["256fds-400stalled", "1024fds-1100stalled"])
def limited_kv_server(request):
    """A kv-server subprocess under a lowered fd limit: (process, url, fd limit, flood size)."""
    fd_limit, flood = request.param
    env = dict(os.environ, AWEX_FAST_ADMIN_KEY=KEY,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    args = ["--idle-timeout", "2", "--header-timeout", "1", "--max-keys", "3", "--max-total-mb", "0.01"]
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(fd_limit), "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (url, proc.poll())
        yield proc, url, fd_limit, flood
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()


def test_stalled_flood_leaves_health_answering_and_fds_bounded(limited_kv_server):
    proc, url, fd_limit, flood = limited_kv_server
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < flood + 100:  # this (test) process holds the client ends
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, flood + 200), hard))
    stalled: list[socket.socket] = []
    try:
        for i in range(flood):
            sock = _connect(url)
            if i % 3 == 0:  # a third start a request head and stop halfway
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            stalled.append(sock)
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        assert fds < fd_limit, f"the server holds {fds} descriptors under a limit of {fd_limit}"
        times = []
        for _ in range(5):  # health answers at once, each time, with the flood still connected
            status, body, took = _get(url, "/health")
            assert (status, body) == (200, {"status": "healthy"})
            times.append(took)
        # unguarded, every try times out; the loose bound on the slowest absorbs a busy test machine
        assert sorted(times)[2] < 1.0 and max(times) < 3.0, f"/health took {times} s under the flood"
        pair = f"p-{uuid.uuid4().hex[:8]}"
        with KVStoreClient(url, KEY, retries=2, backoff=0.05) as kv:
            for i in range(3):
                kv.put(pair, f"k{i}", i)
            with pytest.raises(KVRequestError) as info:  # --max-keys 3
                kv.put(pair, "k3", 3)
            assert info.value.status == 413 and "max_keys" in str(info.value)
            with pytest.raises(KVRequestError) as info:  # --max-total-mb 0.01 = 10485 bytes
                kv.put(pair, "k0", "x" * 20_000)
            assert info.value.status == 413 and "max_total_bytes" in str(info.value)
        # idle 2 s, header 1 s, sweeps every 0.25 s: every stalled socket is closed within ~3 s
        deadline = time.monotonic() + 2.0 + 0.25 + 2.0
        open_ones = stalled
        while open_ones and time.monotonic() < deadline:
            time.sleep(0.2)
            open_ones = [s for s in open_ones if not _closed_now(s)]
        assert not open_ones, f"{len(open_ones)} of {flood} stalled sockets still open after the idle timeout"
    finally:
        for sock in stalled:
            sock.close()
    proc.terminate()
    assert proc.wait(15) == 0
    err = proc.stderr.read()
    assert "Too many open files" not in err and "Traceback" not in err, err[-3000:]
    assert len(err.splitlines()) <= 6, f"the server logged too much:\n{err[-3000:]}"


# --- one limit at a time, in process ------------------------------------------------------------------


@pytest.fixture
def kv_server_short_timeouts():
    limits = ServeLimits(idle_timeout_s=0.6, header_timeout_s=0.5)
    with KVStoreServer(admin_api_key=KEY, limits=limits) as srv:
        yield srv


def test_slow_loris_head_is_dropped_after_the_header_timeout(kv_server_short_timeouts):
    sock = _connect(kv_server_short_timeouts.url)
    with sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        closed_after, data = None, b""
        while time.monotonic() - started < 3.0:  # one header byte every 0.1 s, never a full head
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                break
            chunk, closed_after = _read_until_closed(sock, 0.1)
            data += chunk
            if closed_after is not None:
                break
        took = time.monotonic() - started
    assert data, "the server closed without an answer"
    status, body = _answer(data)
    assert status == 408 and body["limit"] == "header_timeout_s" and body["header_timeout_s"] == 0.5, body
    assert 0.5 <= took < 1.5, f"dropped after {took:.2f} s for a header timeout of 0.5 s"


def test_stalled_body_is_dropped_after_the_idle_timeout(kv_server_short_timeouts):
    sock = _connect(kv_server_short_timeouts.url)
    with sock:
        sock.sendall(b"PUT /weight_meta/p/k HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"value\": ")
        data, took = _read_until_closed(sock, 5.0)
    assert took is not None and 0.6 <= took < 1.6, took
    status, body = _answer(data)
    assert status == 408 and body["limit"] == "idle_timeout_s", body
    with pytest.raises(KeyError):
        kv_server_short_timeouts.store.get("p", "k")


def test_silent_connection_is_closed_after_the_idle_timeout(kv_server_short_timeouts):
    sock = _connect(kv_server_short_timeouts.url)
    with sock:
        data, took = _read_until_closed(sock, 5.0)
    assert data == b"" and took is not None and 0.6 <= took < 1.6, (data, took)


def test_keep_alive_client_and_slow_handler_are_not_cut():
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.5)  # longer than the idle timeout: computing is not idle
        return web.json_response({"done": True})

    def app() -> web.Application:
        application = web.Application(middlewares=[json_error_middleware])
        application.router.add_get("/slow", slow)
        application.router.add_get("/fast", _ok)
        return application

    limits = ServeLimits(idle_timeout_s=0.5, header_timeout_s=0.5)
    with BackgroundServer(app, limits=limits) as srv:
        assert _get(srv.url, "/slow")[:2] == (200, {"done": True})
        conn = http.client.HTTPConnection(*_host_port(srv.url), timeout=5)
        try:
            for _ in range(6):  # requests 0.2 s apart on one kept-alive connection
                conn.request("GET", "/fast")
                resp = conn.getresponse()
                assert resp.status == 200 and json.loads(resp.read()) == {"ok": True}
                time.sleep(0.2)
        finally:
            conn.close()


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _blocking_app(release: threading.Event) -> web.Application:
    async def block(request: web.Request) -> web.Response:
        await asyncio.to_thread(release.wait, 10)
        return web.json_response({"released": True})

    app = web.Application(middlewares=[json_error_middleware])
    app.router.add_get("/block", block)
    app.router.add_get("/health", _ok)
    return app


def test_cap_refuses_with_503_when_all_busy_and_evicts_idle_ones():
    release = threading.Event()
    limits = ServeLimits(idle_timeout_s=30, header_timeout_s=30, max_connections=2)
    with BackgroundServer(lambda: _blocking_app(release), limits=limits) as srv:
        results: list[int] = []
        workers = [threading.Thread(target=lambda: results.append(_get(srv.url, "/block", 15)[0]))
                   for _ in range(2)]
        for worker in workers:
            worker.start()
        time.sleep(0.5)  # both connections now run a handler
        status, body, _ = _get(srv.url, "/health")
        assert status == 503 and body["limit"] == "max_connections" and body["max_connections"] == 2, body
        release.set()
        for worker in workers:
            worker.join(15)
        assert results == [200, 200]
        silent = [_connect(srv.url) for _ in range(3)]  # more idle connections than the cap
        try:
            time.sleep(0.2)
            assert _get(srv.url, "/health")[:2] == (200, {"ok": True})  # evicts the oldest idle ones
            assert sum(_closed_now(s) for s in silent) >= 2
        finally:
            for sock in silent:
                sock.close()


def test_server_key_and_byte_caps_answer_413_naming_the_limit():
    with KVStoreServer(admin_api_key=KEY, max_keys=2, max_total_bytes=1000) as srv, \
            KVStoreClient(srv.url, KEY, retries=0) as kv:
        kv.put("p", "a", 1)
        kv.add_to_set("p", "s", "m")
        with pytest.raises(KVRequestError, match="max_keys") as info:
            kv.put("p", "b", 2)
        assert info.value.status == 413
        with pytest.raises(KVRequestError, match="max_total_bytes") as info:
            kv.put("p", "a", "x" * 2000)
        assert info.value.status == 413
        conn = http.client.HTTPConnection(*_host_port(srv.url), timeout=5)
        try:  # the JSON body names the cap and its value
            conn.request("PUT", "/weight_meta/p/c", body=b'{"value": 3}',
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            resp = conn.getresponse()
            body = json.loads(resp.read())
        finally:
            conn.close()
        assert resp.status == 413 and body["store_full"] is True, body
        assert body["limit"] == "max_keys" and body["max_keys"] == 2, body
    with pytest.raises(ValueError, match="KVStore you give"):
        KVStoreServer(admin_api_key=KEY, store=srv.store, max_keys=3)


BAD_LIMITS = (["--idle-timeout", "0"], ["--header-timeout", "-1"], ["--max-connections", "0"],
              ["--max-keys", "0"], ["--max-total-mb", "0"], ["--max-body-mb", "0"], ["--port", "70000"])


def test_cli_refuses_bad_limits():
    from awex_fast.sync import gateway_main

    for bad in BAD_LIMITS:
        assert kv_server_main(["--admin-key", "k", "--port", "0", *bad]) == 2, bad
        assert gateway_main(["--admin-key", "k", "--port", "0", *bad]) == 2, bad


def test_gateway_command_serves_behind_the_limits_it_is_given():
    # `awex-fast gateway` takes kv-server's limit options: a real gateway process with a short
    # header timeout, a two-key store and a 1 KiB body cap enforces each, and says so at start.
    env = dict(os.environ, AWEX_FAST_ADMIN_KEY=KEY,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    args = ["--port", "0", "--header-timeout", "0.5", "--max-keys", "2", "--max-body-mb", str(1 / 1024)]
    proc = subprocess.Popen([sys.executable, "-m", "awex_fast.cli", "gateway", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (url, proc.poll())
        banner = proc.stderr.readline()
        assert "store limits 2 keys" in banner and "body limit 1024 bytes" in banner, banner
        assert "header 0.5 s" in banner, banner
        with _connect(url) as sock:  # a head that never ends
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            data, closed_after = _read_until_closed(sock, 5.0)
        assert closed_after is not None and closed_after < 2.0, closed_after
        status, body = _answer(data)
        assert status == 408 and body["limit"] == "header_timeout_s", body
        with KVStoreClient(url, KEY, retries=0) as kv:
            kv.put("p", "a", 1)
            kv.put("p", "b", 2)
            with pytest.raises(KVRequestError, match="max_keys") as info:
                kv.put("p", "c", 3)
            assert info.value.status == 413
            with pytest.raises(KVRequestError) as info:
                kv.put("p", "a", "x" * 2000)
            assert info.value.status == 413
            assert kv.get("p", "a") == 1  # the refused write changed nothing
    finally:
        proc.terminate()
        assert proc.wait(15) == 0


def test_serve_limits_validate_and_stay_below_the_fd_limit():
    with pytest.raises(ValueError, match="idle_timeout_s"):
        ServeLimits(idle_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections"):
        ServeLimits(max_connections=0)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits = ServeLimits(max_connections=10**9)
    if soft != resource.RLIM_INFINITY:
        backlog = limits.effective_backlog()
        assert backlog <= max(16, soft // 8)
        assert limits.effective_max_connections() <= soft - max(3 * backlog + 64, soft // 4)
    assert ServeLimits(max_connections=7).effective_max_connections() <= 7
