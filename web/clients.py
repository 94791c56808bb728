"""Noticing a client that went away while its request is still being answered.

A streaming response notices at its next write; a non-streaming one writes nothing
until the end, so it looks at the connection itself: under gunicorn the WSGI environ
carries the socket (``gunicorn.socket``), and a peek that reads end-of-file means the
client closed its side. Bytes waiting (a pipelined next request) mean it is still there.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable, Mapping
from typing import Any


def client_gone_probe(environ: Mapping[str, Any]) -> Callable[[], bool]:
    """A cheap check, callable many times, of whether the client hung up."""
    sock = environ.get("gunicorn.socket")
    if not isinstance(sock, socket.socket):
        return lambda: False  # no socket to look at (tests' client, other servers)

    def gone() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            return True

    return gone
