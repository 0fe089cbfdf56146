"""Free TCP ports for servers and rendezvous stores that are told a port rather than binding 0."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago.

    The port is released before it is returned, so another process may take it first: use it only
    where the consumer cannot bind port 0 itself and report the port it got (vLLM's
    ``--port``, torch's ``MASTER_PORT``); the project's own servers and stores bind port 0.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
