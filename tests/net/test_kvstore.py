"""KV store: real aiohttp servers on 127.0.0.1 port 0, real HTTP, CPU only.

Covers the routes and answers, auth (401/403 on writes and reads, the anonymous-read switch),
body limits (413 by Content-Length and while streaming), malformed bodies (400), concurrent
writers, ``wait`` timing, bounded retries (dead port, 5xx retried, 4xx not), the
``kv-server`` CLI as a subprocess, and that the module never touches pickle.
"""

from __future__ import annotations

import ast
import asyncio
import http.client
import json
import logging
import os
import signal
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
    AsyncKVStoreClient,
    BackgroundServer,
    KVAuthError,
    KVKeyError,
    KVRequestError,
    KVStore,
    KVStoreClient,
    KVStoreError,
    KVStoreServer,
    KVTimeoutError,
    KVUnavailableError,
    kv_server_main,
)

KEY = "test-admin-key"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    with KVStoreServer(admin_api_key=KEY, max_body_bytes=4096) as srv:
        yield srv


@pytest.fixture(scope="module")
def anon_server():
    with KVStoreServer(admin_api_key=KEY, allow_anonymous_reads=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def kv(server):
    with KVStoreClient(server.url, KEY, timeout=5.0) as client:
        yield client


@pytest.fixture
def pair():
    return f"pair-{uuid.uuid4().hex[:8]}"


def raw(port, method, path, body=None, headers=None, chunked=False):
    """One request over http.client: (status, parsed JSON body or raw bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        if chunked:
            conn.request(method, path, body=iter([body]), headers=headers or {}, encode_chunked=True)
        else:
            conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, data


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [{"a": [1, 2.5, None, True], "nested": {"é": "ünïcode"}}, [], "text", 0, -3.25, None, False],
)
def test_json_round_trip(kv, pair, value):
    kv.put(pair, "k", value)
    assert kv.get(pair, "k") == value
    kv.put(pair, "k", {"overwritten": 1})
    assert kv.get(pair, "k") == {"overwritten": 1}
    assert kv.delete(pair, "k") is True
    assert kv.delete(pair, "k") is False  # idempotent, as AReaL's gateway answers
    with pytest.raises(KVKeyError) as info:
        kv.get(pair, "k")
    assert info.value.status == 404 and "'k'" in str(info.value) and pair in str(info.value)


def test_bytes_round_trip_and_raw_shape(kv, server, pair):
    data = bytes(range(256)) * 4
    kv.put_bytes(pair, "blob", data)
    kv.put_bytes(pair, "empty", b"")
    assert kv.get_bytes(pair, "blob") == data
    assert kv.get_bytes(pair, "empty") == b""
    # The wire value is a plain base64 string inside {"value": ...}, readable by any client.
    status, body = raw(server.port, "GET", f"/weight_meta/{pair}/blob", headers=AUTH)
    assert status == 200 and isinstance(body["value"], str)
    kv.put(pair, "not-b64", "this is not base64!")
    with pytest.raises(KVStoreError, match="not-b64"):
        kv.get_bytes(pair, "not-b64")
    kv.put(pair, "number", 5)
    with pytest.raises(KVStoreError, match="not a base64 string"):
        kv.get_bytes(pair, "number")


def test_unknown_key_is_404_with_json_error(server, kv, pair):
    status, body = raw(server.port, "GET", f"/weight_meta/{pair}/missing", headers=AUTH)
    assert status == 404 and "missing" in body["error"]
    with pytest.raises(KVKeyError):
        kv.get(pair, "missing")
    with pytest.raises(KeyError):  # KVKeyError is also a KeyError
        kv.get(pair, "missing")
    status, body = raw(server.port, "GET", "/no/such/route", headers=AUTH)
    assert status == 404 and "error" in body


def test_sets_are_idempotent_and_separate_from_values(kv, pair):
    assert kv.set_size(pair, "acks") == 0 and kv.set_members(pair, "acks") == []
    for member in ["r1", "r0", "r1", "r2", "r0"]:
        kv.add_to_set(pair, "acks", member)
    assert kv.set_size(pair, "acks") == 3
    assert kv.set_members(pair, "acks") == ["r0", "r1", "r2"]  # sorted, each once
    with pytest.raises(KVKeyError):
        kv.get(pair, "acks")  # a set is not a value
    with pytest.raises(TypeError, match="str"):
        kv.add_to_set(pair, "acks", 3)


def test_server_store_is_usable_in_process(server, kv, pair):
    kv.put(pair, "x", {"v": 1})
    assert server.store.get(pair, "x") == {"v": 1}
    server.store.put(pair, "y", [1, 2])
    assert kv.get(pair, "y") == [1, 2]
    server.store.clear_pair(pair)
    with pytest.raises(KVKeyError):
        kv.get(pair, "x")


def test_bad_names_are_rejected_client_side(kv):
    with pytest.raises(ValueError, match="key"):
        kv.get("p", "a/b")
    with pytest.raises(ValueError, match="pair name"):
        kv.put("", "k", 1)
    with pytest.raises(ValueError, match="key"):
        kv.get("p", "..")


def test_names_with_reserved_characters_round_trip(kv, pair):
    key = "plan digest?rank=1#x%20"
    kv.put(pair, key, "ok")
    assert kv.get(pair, key) == "ok"


# --- auth ----------------------------------------------------------------------------------------


def test_writes_need_the_key(server, kv, pair):
    anon, bad = KVStoreClient(server.url, "", retries=0), KVStoreClient(server.url, "wrong", retries=0)
    with anon, bad:
        for client, status in ((anon, 401), (bad, 403)):
            for call in (lambda c: c.put(pair, "w", 1), lambda c: c.delete(pair, "w"),
                         lambda c: c.add_to_set(pair, "s", "m"), lambda c: c.put_bytes(pair, "w", b"x")):
                with pytest.raises(KVAuthError) as info:
                    call(client)
                assert info.value.status == status
    with pytest.raises(KVKeyError):
        kv.get(pair, "w")  # nothing was written
    assert kv.set_size(pair, "s") == 0
    status, body = raw(server.port, "PUT", f"/weight_meta/{pair}/w", b'{"value": 1}',
                       {"Authorization": "Basic abc"})
    assert status == 401 and "Bearer" in body["error"]


def test_reads_need_the_key_when_anonymous_reads_are_off(server, kv, pair):
    kv.put(pair, "r", 1)
    anon, bad = KVStoreClient(server.url, "", retries=0), KVStoreClient(server.url, "wrong", retries=0)
    with anon, bad:
        for client, status in ((anon, 401), (bad, 403)):
            with pytest.raises(KVAuthError) as info:
                client.get(pair, "r")
            assert info.value.status == status and str(status) in str(info.value)
            with pytest.raises(KVAuthError):
                client.set_size(pair, "r")
            with pytest.raises(KVAuthError):
                client.wait(pair, "r", timeout=5.0)  # auth errors end a wait at once
        assert anon.health()["status"] == "healthy"  # health needs no key


def test_anonymous_read_switch(anon_server, pair):
    with KVStoreClient(anon_server.url, KEY) as admin, KVStoreClient(anon_server.url, "", retries=0) as anon:
        admin.put(pair, "meta", {"m": 1})
        admin.add_to_set(pair, "s", "a")
        assert anon.get(pair, "meta") == {"m": 1}
        assert anon.set_size(pair, "s") == 1
        assert anon.wait(pair, "meta", timeout=1.0) == {"m": 1}
        with pytest.raises(KVAuthError) as info:
            anon.put(pair, "meta", 2)
        assert info.value.status == 401
    with KVStoreClient(anon_server.url, "wrong", retries=0) as bad:
        with pytest.raises(KVAuthError) as info:
            bad.put(pair, "meta", 2)
        assert info.value.status == 403
    assert anon_server.store.get(pair, "meta") == {"m": 1}


def test_server_refuses_to_start_without_a_key(monkeypatch):
    monkeypatch.delenv("AWEX_FAST_ADMIN_KEY", raising=False)
    with pytest.raises(ValueError, match="admin_api_key"):
        KVStoreServer()
    with pytest.raises(ValueError, match="admin_api_key"):
        KVStoreServer(admin_api_key="")
    for blank in (" ", "\t\n"):  # nothing could authenticate: bearer tokens are stripped
        with pytest.raises(ValueError, match="admin_api_key"):
            KVStoreServer(admin_api_key=blank)


# --- body limits and malformed bodies ---------------------------------------------------------------


def test_oversized_body_is_413(server, kv, pair):
    with pytest.raises(KVRequestError) as info:
        kv.put(pair, "big", "x" * 10_000)  # server cap is 4096 bytes
    assert info.value.status == 413 and "4096" in str(info.value)
    with pytest.raises(KVKeyError):
        kv.get(pair, "big")
    kv.put(pair, "fits", "x" * 4000)  # just under the cap still lands
    assert len(kv.get(pair, "fits")) == 4000
    # No Content-Length (chunked): the cap is enforced while reading.
    body = json.dumps({"value": "y" * 10_000}).encode()
    status, answer = raw(server.port, "PUT", f"/weight_meta/{pair}/chunked", body, AUTH, chunked=True)
    assert status == 413 and "4096" in answer["error"]
    status, _ = raw(server.port, "PUT", f"/weight_meta/{pair}/set/s", body, AUTH)
    assert status == 413
    with pytest.raises(KVKeyError):
        kv.get(pair, "chunked")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"value": ', "malformed JSON"),
        (b"\xff\xfe\x00garbage", "malformed JSON"),
        (b"", "empty"),
        (b"[1, 2]", "JSON object"),
        (b'{"val": 1}', "'value'"),
        (b'{"value": NaN}', "NaN"),
        (b'{"value": 1e400}', "float64 range"),  # parses to inf: was a 500
        (b'{"value": ' + b"[" * 1500 + b"]" * 1500 + b"}", "nested too deeply"),  # was a 500
    ],
)
def test_malformed_body_is_400(server, kv, pair, body, needle):
    for path in (f"/weight_meta/{pair}/k", f"/weight_meta/{pair}/set/k"):
        status, answer = raw(server.port, "PUT", path, body, AUTH)
        assert status == 400, answer
        assert needle in answer["error"]
    with pytest.raises(KVKeyError):
        kv.get(pair, "k")


def test_set_member_must_be_a_string(server, pair):
    status, answer = raw(server.port, "PUT", f"/weight_meta/{pair}/set/k", b'{"value": 3}', AUTH)
    assert status == 400 and "string" in answer["error"]


def test_client_rejects_non_json_values(kv, pair):
    with pytest.raises(TypeError, match="'k'"):
        kv.put(pair, "k", {1, 2})
    with pytest.raises(TypeError, match="'k'"):
        kv.put(pair, "k", float("nan"))


# --- concurrency and wait --------------------------------------------------------------------------


def test_concurrent_writers(server, kv, pair):
    threads_n, per_thread = 8, 25
    errors = []

    def writer(t):
        try:
            own = KVStoreClient(server.url, KEY) if t % 2 else None  # half share one client
            client = own or kv
            for i in range(per_thread):
                client.put(pair, f"t{t}_k{i}", {"t": t, "i": i})
                client.add_to_set(pair, "members", f"t{t}_m{i}")
                client.add_to_set(pair, "members", f"t{t}_m{i // 2}")  # duplicates
            if own:
                own.close()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert kv.set_size(pair, "members") == threads_n * per_thread
    for t in range(threads_n):
        for i in range(per_thread):
            assert kv.get(pair, f"t{t}_k{i}") == {"t": t, "i": i}
    assert len(server.store.keys(pair)) == threads_n * per_thread


def test_wait_times_out_within_bounds(kv, pair):
    start = time.monotonic()
    with pytest.raises(KVTimeoutError) as info:
        kv.wait(pair, "never_written", timeout=0.5)
    elapsed = time.monotonic() - start
    assert 0.5 <= elapsed < 2.0, elapsed  # 1.5 s of slack for a loaded 2-core CI box
    assert "never_written" in str(info.value) and pair in str(info.value)
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(KVTimeoutError, match="3 members"):
        kv.wait_set_size(pair, "nobody", 3, timeout=0.2)


def test_wait_succeeds_when_written_later(server, kv, pair):
    def later():
        time.sleep(0.3)
        with KVStoreClient(server.url, KEY) as other:
            other.put_bytes(pair, "late", b"\x01\x02")
            for r in range(3):
                other.add_to_set(pair, "acks", f"rank{r}")

    th = threading.Thread(target=later)
    start = time.monotonic()
    th.start()
    assert kv.wait_bytes(pair, "late", timeout=10.0) == b"\x01\x02"
    assert kv.wait_set_size(pair, "acks", 3, timeout=10.0) == 3
    elapsed = time.monotonic() - start
    th.join(10)
    assert 0.3 <= elapsed < 3.0, elapsed


def test_wait_survives_a_server_that_starts_late():
    port = free_port()
    srv = KVStoreServer(port=port, admin_api_key=KEY)
    timer = threading.Timer(0.4, lambda: (srv.start(), srv.store.put("p", "k", "up")))
    timer.start()
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", KEY) as client:
            assert client.wait("p", "k", timeout=10.0) == "up"
    finally:
        timer.join(10)
        srv.stop()


# --- retries -----------------------------------------------------------------------------------------


def test_dead_port_fails_after_bounded_retries():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with KVStoreClient(url, KEY, timeout=1.0, retries=2, backoff=0.05) as client, \
            pytest.raises(KVUnavailableError) as info:
        client.get("p", "k")
    elapsed = time.monotonic() - start
    assert elapsed < 3.0, elapsed
    assert info.value.attempts == 3
    assert url in str(info.value) and "3 attempt" in str(info.value)
    assert isinstance(info.value, ConnectionError)


def test_5xx_is_retried_and_4xx_is_not():
    hits = {"flaky": 0, "denied": 0, "recover": 0, "bad": 0}

    async def handler(request):
        name = request.match_info["key"]
        hits[name] += 1
        if name == "flaky" or (name == "recover" and hits[name] == 1):
            return web.json_response({"error": "try later"}, status=503)
        if name == "denied":
            return web.json_response({"error": "no"}, status=403)
        if name == "bad":
            return web.json_response({"error": "bad body"}, status=400)
        return web.json_response({"value": 7})

    app = web.Application()
    app.router.add_get("/weight_meta/{pair}/{key}", handler)
    with BackgroundServer(app) as srv, KVStoreClient(srv.url, KEY, retries=2, backoff=0.01) as client:
        with pytest.raises(KVUnavailableError, match="503") as info:
            client.get("p", "flaky")
        assert info.value.status == 503 and hits["flaky"] == 3
        with pytest.raises(KVAuthError, match="no"):
            client.get("p", "denied")
        assert hits["denied"] == 1
        with pytest.raises(KVRequestError, match="bad body"):
            client.get("p", "bad")
        assert hits["bad"] == 1
        assert client.get("p", "recover") == 7 and hits["recover"] == 2


# --- loops and lifecycle -----------------------------------------------------------------------------


def test_sync_client_works_from_a_thread_running_a_loop(server, kv, pair):
    kv.put(pair, "k", "v")

    async def inside_loop():
        with KVStoreClient(server.url, KEY) as client:  # asyncio.run per call would fail here
            return client.get(pair, "k")

    assert asyncio.run(inside_loop()) == "v"


def test_async_server_and_client_in_one_loop(pair):
    async def main():
        async with KVStoreServer(admin_api_key=KEY) as srv, AsyncKVStoreClient(srv.url, KEY) as client:
            await client.put(pair, "k", [1])
            await client.put_bytes(pair, "b", b"abc")
            waiter = asyncio.create_task(client.wait(pair, "late", timeout=5.0))
            await asyncio.sleep(0.05)
            await client.put(pair, "late", "here")
            return await client.get(pair, "k"), await client.get_bytes(pair, "b"), await waiter

    assert asyncio.run(main()) == ([1], b"abc", "here")


def test_restart_keeps_the_store_and_closed_client_refuses(pair):
    srv = KVStoreServer(admin_api_key=KEY)
    with srv, KVStoreClient(srv.url, KEY) as client:
        client.put(pair, "k", 1)
    assert not srv.running
    with pytest.raises(RuntimeError, match="not running"):
        _ = srv.url
    with srv, KVStoreClient(srv.url, KEY) as client:
        assert client.get(pair, "k") == 1
    with pytest.raises(RuntimeError, match="closed"):
        client.get(pair, "k")


# --- CLI -------------------------------------------------------------------------------------------------


def _read_first_line(proc, timeout):
    box = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    line = box[0].strip() if box else ""
    if not line:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"kv-server printed no URL within {timeout} s (rc {proc.returncode}); "
                             f"stderr:\n{err[-3000:]}")
    return line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_serves_until_signal(pair, sig):
    env = dict(os.environ, AWEX_FAST_ADMIN_KEY=KEY,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    code = "import sys; from awex_fast.net import kv_server_main; sys.exit(kv_server_main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--port", "0", "--max-body-mb", "0.001"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = _read_first_line(proc, 30)
        assert url.startswith("http://127.0.0.1:"), url
        with KVStoreClient(url, KEY) as client:
            client.put(pair, "k", {"from": "cli"})
            assert client.get(pair, "k") == {"from": "cli"}
            with pytest.raises(KVRequestError) as info:
                client.put(pair, "big", "x" * 2000)  # --max-body-mb 0.001 = 1048 bytes
            assert info.value.status == 413
        with KVStoreClient(url, "", retries=0) as anon, pytest.raises(KVAuthError):
            anon.get(pair, "k")  # no --allow-anonymous-reads
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()


def test_cli_without_a_key_exits_2(monkeypatch, capsys):
    monkeypatch.delenv("AWEX_FAST_ADMIN_KEY", raising=False)
    assert kv_server_main(["--port", "0"]) == 2
    assert "admin key" in capsys.readouterr().err
    assert kv_server_main(["--admin-key", "k", "--max-body-mb", "0"]) == 2


# --- no pickle -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["net/kvstore.py", "net/kv_server.py", "net/kv_client.py",
                                    "net/httputil.py", "net/serving.py", "net/conn_guard.py"])
def test_module_never_uses_pickle(module):
    tree = ast.parse((REPO / "awex_fast" / module).read_text())
    banned = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in banned]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in banned:
                found.append(node.module)
        elif isinstance(node, ast.Name) and node.id in banned:
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and (node.attr in banned or "pickle" in node.attr.lower()):
            found.append(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            found.append("__import__")
    assert not found, f"{module} touches {found}"


def test_client_leaving_mid_body_logs_one_short_line(server, pair, caplog):
    caplog.set_level(logging.DEBUG)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(f"PUT /weight_meta/{pair}/k HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"value\":".encode())
        time.sleep(0.3)
    deadline = time.monotonic() + 5
    while not any("left during the body" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
    time.sleep(0.3)  # anything else the server would log about it
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert noisy == [], [r.getMessage() for r in noisy]  # was a 1.2 kB "unhandled error" traceback
    (line,) = [r.getMessage() for r in caplog.records if "left during the body" in r.getMessage()]
    assert len(line) < 200 and pair in line


def test_key_count_and_total_bytes_are_capped():
    with KVStoreServer(admin_api_key=KEY, store=KVStore(max_keys=2, max_total_bytes=200)) as srv:
        put = lambda key, body: raw(srv.port, "PUT", f"/weight_meta/p/{key}", body, AUTH)  # noqa: E731
        assert put("a", b'{"value": 1}')[0] == 200
        assert put("set/s", b'{"value": "m"}')[0] == 200
        status, answer = put("b", b'{"value": 2}')  # a third key
        assert status == 413 and answer["store_full"] and "limit of 2 keys" in answer["error"], answer
        assert put("a", b'{"value": 3}')[0] == 200  # an overwrite is no new key
        status, answer = put("a", json.dumps({"value": "x" * 300}).encode())
        assert status == 413 and "limit of 200 bytes" in answer["error"], answer
        assert raw(srv.port, "DELETE", "/weight_meta/p/a", None, AUTH)[0] == 200
        assert put("b", b'{"value": 2}')[0] == 200  # the delete made room
    with pytest.raises(ValueError, match="max_keys"):
        KVStore(max_keys=0)
