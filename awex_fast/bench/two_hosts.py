"""Two network hosts on one machine: a "trainer host" and an "engine host", each a Linux network
namespace with an address of its own, joined by one veth link shaped with ``tc netem`` (rate,
delay, loss). What loopback hides shows here: a store bound to the wrong interface, an address
the other side cannot reach, a link that goes down mid-round, transfer times set by the link.

    with TwoHosts(gbps=10) as hosts:
        engine = hosts.popen("engine", ["python", "-m", "vllm.entrypoints.openai.api_server", ...])
        hosts.run("trainer", ["python", "train.py", "--engine", f"http://{hosts.address('engine')}:8000"])
        hosts.set_link(up=False)           # the cable pulled
        hosts.shape(gbps=1)                # a slower link (delay_ms / loss_pct: where netem exists)

Needs root (``ip netns`` / ``tc``); `available` says whether this process can, and why not.
Everything is created on entry and removed on exit (the namespaces, and the veth pair with them),
also after an error; nothing leaves the machine.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TwoHosts", "TwoHostsError", "available"]

HOSTS = ("trainer", "engine")


class TwoHostsError(RuntimeError):
    """A namespace, link or shaping command failed; names the command and what it printed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise TwoHostsError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def available() -> tuple[bool, str]:
    """(whether two hosts can be made here, why not)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "needs iproute2 (ip, tc)"
    try:  # the whole build once: namespaces, the veth pair, addresses, rate shaping
        with TwoHosts(gbps=1.0):
            pass
    except (TwoHostsError, OSError, subprocess.SubprocessError) as exc:
        return False, f"two hosts cannot be built here: {exc}"
    return True, ""


class TwoHosts:
    """The two hosts (module docstring). ``gbps`` / ``delay_ms`` / ``loss_pct`` shape both
    directions of the link (delay and loss need the kernel's netem qdisc; rate alone is a token
    bucket); ``subnet`` picks the /24 (default: a random 10.x.y.0/24)."""

    def __init__(self, gbps: float = 10.0, delay_ms: float = 0.0, loss_pct: float = 0.0,
                 subnet: str | None = None, trainer_in_root: bool = False) -> None:
        token = secrets.token_hex(3)
        # trainer_in_root: the trainer host is this process's own namespace (its tests and
        # trainer ranks run as usual and reach the engine host over the link)
        self.namespaces = {"trainer": None if trainer_in_root else f"awex-trainer-{token}",
                           "engine": f"awex-engine-{token}"}
        self.devices = {"trainer": f"awt{token}", "engine": f"awe{token}"}  # interface names <= 15 chars
        net = subnet or f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
        self.addresses = {"trainer": f"{net}.1", "engine": f"{net}.2"}
        self.shaping = {"gbps": gbps, "delay_ms": delay_ms, "loss_pct": loss_pct}
        self._made: list[str] = []

    def address(self, host: str) -> str:
        """The host's own address on the link (what the other host reaches it by)."""
        return self.addresses[self._host(host)]

    def _host(self, host: str) -> str:
        if host not in HOSTS:
            raise ValueError(f"host must be one of {HOSTS}, got {host!r}")
        return host

    def __enter__(self) -> TwoHosts:
        try:
            for host in HOSTS:
                if self.namespaces[host] is not None:
                    _ip("netns", "add", self.namespaces[host])
                    self._made.append(self.namespaces[host])
            _ip("link", "add", self.devices["trainer"], "type", "veth", "peer", "name",
                self.devices["engine"])
            self._made_link = True
            for host in HOSTS:
                ns, dev = self.namespaces[host], self.devices[host]
                if ns is not None:
                    _ip("link", "set", dev, "netns", ns)
                    _ip(*self._in(host), "link", "set", "lo", "up")
                _ip(*self._in(host), "addr", "add", f"{self.addresses[host]}/24", "dev", dev)
                _ip(*self._in(host), "link", "set", dev, "up")
            self._tc("add", **self.shaping)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _in(self, host: str) -> list[str]:
        """``ip`` arguments that address ``host``'s namespace."""
        ns = self.namespaces[host]
        return [] if ns is None else ["-n", ns]

    def close(self) -> None:
        """Remove the namespaces (the veth pair goes with them; a root-side end is deleted);
        safe to call twice."""
        if self.namespaces["trainer"] is None and getattr(self, "_made_link", False):
            _ip("link", "del", self.devices["trainer"], check=False)
            self._made_link = False
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)

    def _tc(self, verb: str, gbps: float, delay_ms: float, loss_pct: float) -> None:
        # rate alone: a token bucket (tbf), in every kernel; delay or loss need netem, which some
        # kernels lack (then the error says so rather than shaping less than asked)
        burst = max(64 << 10, int(gbps * 1e9 / 8 / 250))  # at least one 4 ms tick of tokens
        for host in HOSTS:
            head = ["tc", *self._in(host), "qdisc", verb, "dev", self.devices[host], "root"]
            if delay_ms or loss_pct:
                args = [*head, "netem", "rate", f"{gbps}gbit", "delay", f"{delay_ms}ms",
                        "loss", f"{loss_pct}%"]
            else:
                args = [*head, "tbf", "rate", f"{gbps}gbit", "burst", str(burst), "latency", "20ms"]
            proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                hint = (" (this kernel has no netem qdisc: give delay_ms=0 and loss_pct=0 for rate shaping "
                        "alone)" if "netem" in args and "unknown" in proc.stderr else "")
                raise TwoHostsError(f"`{' '.join(args)}` failed ({proc.returncode}): "
                                    f"{proc.stderr.strip()}{hint}")

    def shape(self, gbps: float | None = None, delay_ms: float | None = None,
              loss_pct: float | None = None) -> None:
        """Change the link's shaping (both directions); unset values stay."""
        before = dict(self.shaping)
        for key, value in (("gbps", gbps), ("delay_ms", delay_ms), ("loss_pct", loss_pct)):
            if value is not None:
                self.shaping[key] = value
        kind = lambda s: bool(s["delay_ms"] or s["loss_pct"])  # noqa: E731 - netem or tbf
        self._tc("change" if kind(before) == kind(self.shaping) else "replace", **self.shaping)

    def set_link(self, up: bool) -> None:
        """Take the link down (both ends, as a pulled cable) or bring it back."""
        for host in HOSTS:
            _ip(*self._in(host), "link", "set", self.devices[host], "up" if up else "down")

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``."""
        ns = self.namespaces[self._host(host)]
        return list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]

    def popen(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (``env`` added to this process's environment)."""
        full_env = {**os.environ, **(env or {})}
        return subprocess.Popen(self.command(host, argv), env=full_env, **kwargs)

    def run(self, host: str, argv: Sequence[str], timeout: float = 120.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to completion, output captured."""
        full_env = {**os.environ, **(env or {})}
        return subprocess.run(self.command(host, argv), env=full_env, capture_output=True, text=True,
                              timeout=timeout)
