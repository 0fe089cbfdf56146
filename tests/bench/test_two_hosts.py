"""The two-host harness (awex_fast.bench.two_hosts) for real: two network namespaces, a veth
link shaped with tc. A TCP stream from the trainer host to the engine host runs at the shaped
rate, not at memory speed; each host's loopback is its own (the engine's 127.0.0.1 is not the
trainer's); a link taken down refuses connections until it is back; nothing is left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from awex_fast.bench.two_hosts import TwoHosts, available

ok, why = available()
pytestmark = [pytest.mark.skipif(not ok, reason=why), pytest.mark.timeout(300)]

PORT = 47311
SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(4); print("ready", flush=True)
while True:
    c, _ = s.accept(); n = 0; t0 = None
    while chunk := c.recv(1 << 20):
        t0 = t0 or time.perf_counter(); n += len(chunk)
    print(n, time.perf_counter() - (t0 or time.perf_counter()), flush=True); c.close()
"""
SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
s.sendall(b"x" * int(sys.argv[3])); s.close()
"""


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _send(hosts: TwoHosts, to: str, nbytes: int, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return hosts.run("trainer", [sys.executable, "-c", SEND, to, str(PORT), str(nbytes), str(timeout)],
                     timeout=timeout + 10)


def test_a_shaped_link_between_two_hosts():
    with TwoHosts(gbps=1.0) as hosts:
        names = set(hosts.namespaces.values())
        sink = hosts.popen("engine", [sys.executable, "-c", SINK, "0.0.0.0", str(PORT)],
                           stdout=subprocess.PIPE, text=True)
        try:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
            nbytes = 40 << 20
            assert _send(hosts, hosts.address("engine"), nbytes).returncode == 0
            got, seconds = sink.stdout.readline().split()
            gbps = int(got) * 8 / float(seconds) / 1e9
            assert int(got) == nbytes and 0.4 < gbps < 1.15, f"{gbps:.2f} Gbit/s over a 1 Gbit/s link"
            # the trainer host's loopback is its own: the engine's port is not there
            assert _send(hosts, "127.0.0.1", 10, timeout=3).returncode != 0
            hosts.set_link(up=False)
            assert _send(hosts, hosts.address("engine"), 10, timeout=3).returncode != 0
            hosts.set_link(up=True)
            hosts.shape(gbps=2.0)
            assert _send(hosts, hosts.address("engine"), 1 << 20).returncode == 0
            assert int(sink.stdout.readline().split()[0]) == 1 << 20
        finally:
            sink.kill()
            sink.wait()
    assert not names & _namespaces()


def test_delay_or_loss_needs_netem_and_says_so_where_the_kernel_lacks_it():
    """Delay and loss are netem's; on a kernel without it the harness refuses with the reason
    (never a link shaped less than asked), and leaves nothing behind either way."""
    from awex_fast.bench.two_hosts import TwoHostsError

    hosts = TwoHosts(gbps=1.0, loss_pct=5.0)
    try:
        with hosts:
            pass
    except TwoHostsError as exc:
        assert "no netem qdisc" in str(exc), str(exc)
    assert not set(hosts.namespaces.values()) & _namespaces()
