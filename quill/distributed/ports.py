"""A free port on this host, for the rendezvous of ranks, KV links and local instances
(torch-free, so that the HTTP server can use it without loading torch)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on this host now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
