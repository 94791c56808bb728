"""The ports of the servers ``tokenrelay up`` starts: each a port number (1-65535).

A bad port is refused here, before any process starts, rather than left to the server
that cannot use it: a redis-server given port 0 listens nowhere and would be restarted
until ``up`` gave up, with a hint (a damaged Redis file) that does not fit.
"""

from __future__ import annotations

import argparse

MAX_PORT = 65535


def port_number(text: str) -> int:
    """argparse's ``type`` for a port option, so that argparse's error names the flag
    (``argument --redis-port: '70000' is not a port number (1-65535)``, exit status 2)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-{MAX_PORT})")
    return port
