"""The serving limits every ``awex-fast`` server command takes (``kv-server`` and ``gateway``):
one set of command-line options, parsed and checked once, so the two servers cannot drift apart.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from awex_fast.net.conn_guard import ServeLimits
from awex_fast.net.kvstore import DEFAULT_MAX_KEYS, DEFAULT_MAX_TOTAL_BYTES

DEFAULT_MAX_BODY_BYTES = 256 << 20
_MIB = 1 << 20


@dataclass(frozen=True)
class ServerSettings:
    """What the options asked for: connection limits, request body cap and KV store caps."""

    limits: ServeLimits
    max_body_bytes: int
    max_keys: int
    max_total_bytes: int

    def describe(self) -> str:
        """One banner fragment naming every limit in force."""
        return (f"body limit {self.max_body_bytes} bytes, store limits {self.max_keys} keys / "
                f"{self.max_total_bytes} bytes, {self.limits.effective_max_connections()} connections, "
                f"idle {self.limits.idle_timeout_s:g} s, header {self.limits.header_timeout_s:g} s")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the address options and those for the body, KV store and connection limits to
    ``parser``."""
    defaults = ServeLimits()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 lets the OS choose (default)")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / _MIB,
                        help="request body limit in MiB (default 256); larger bodies get 413")
    parser.add_argument("--max-keys", type=int, default=DEFAULT_MAX_KEYS,
                        help=f"most keys (values and sets) the KV store holds (default {DEFAULT_MAX_KEYS}); "
                             "more get 413")
    parser.add_argument("--max-total-mb", type=float, default=DEFAULT_MAX_TOTAL_BYTES / _MIB,
                        help="most MiB of values, members and names the KV store holds (default "
                             f"{DEFAULT_MAX_TOTAL_BYTES // _MIB}); more get 413")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help=f"most open connections (default {defaults.max_connections}, always kept "
                             "below the process's open-file limit)")
    parser.add_argument("--idle-timeout", type=float, default=defaults.idle_timeout_s,
                        help="seconds a connection may send nothing while no request runs or a body is "
                             f"due (default {defaults.idle_timeout_s:g})")
    parser.add_argument("--header-timeout", type=float, default=defaults.header_timeout_s,
                        help="seconds a request head may take to arrive "
                             f"(default {defaults.header_timeout_s:g})")


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The settings the options of `add_server_arguments` asked for (the address stays in
    ``args``); ValueError names the first option out of range."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    max_body = int(args.max_body_mb * _MIB)
    max_total = int(args.max_total_mb * _MIB)
    if max_body <= 0 or max_total <= 0 or args.max_keys < 1:
        raise ValueError(f"--max-body-mb (got {args.max_body_mb}), --max-total-mb (got {args.max_total_mb}) "
                         f"and --max-keys (got {args.max_keys}) must be > 0")
    limits = ServeLimits(idle_timeout_s=args.idle_timeout, header_timeout_s=args.header_timeout,
                         max_connections=args.max_connections)
    return ServerSettings(limits, max_body, args.max_keys, max_total)
