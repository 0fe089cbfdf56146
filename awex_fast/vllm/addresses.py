"""Which addresses a trainer offers the vLLM side, when trainer and vLLM run on different hosts.

Two addresses must be reachable from the vLLM workers: the KV store trainer rank 0 hosts
(``kv_host``), and the transfer group's rendezvous, which inference transfer rank 0 (worker 0 of
engine 0) binds (``master_address``). Left out, they are found from the servers' URLs: the KV
store binds the address of the interface this host reaches the first remote server through,
and the rendezvous binds that server's own host; on one host both stay on loopback. A loopback
``kv_host`` given while a server is on another host is refused before anything waits on it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

from awex_fast.transport.torch_dist import address_towards

__all__ = ["is_loopback", "resolve_addresses", "server_host"]

LOOPBACK = "127.0.0.1"


def server_host(client: Any) -> str | None:
    """The host of a client's vLLM server (its ``base_url``), or None for an in-process engine."""
    url = getattr(client, "base_url", None)
    return urlparse(str(url)).hostname if url else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this host's loopback (an address, or a name that resolves to one)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def resolve_addresses(clients: Sequence[Any], kv_host: str | None,
                      master_address: str | None) -> tuple[str, str]:
    """(the address the KV store binds, the transfer rendezvous address) for these clients."""
    remote = [h for h in map(server_host, clients) if h and not is_loopback(h)]
    if kv_host is None:
        kv_host = (address_towards(remote[0]) if remote else None) or LOOPBACK
    elif remote and is_loopback(kv_host):
        raise ValueError(f"kv_host {kv_host!r} is this host's loopback, but the vLLM server at {remote[0]} "
                         "is on another host and could not reach the KV store; give kv_host an address of "
                         "this host that it reaches, or leave it out (awex_fast binds the interface that "
                         "routes to it)")
    if master_address is None:
        first = server_host(clients[0]) if clients else None
        master_address = first if first and not is_loopback(first) else LOOPBACK
    return kv_host, master_address
