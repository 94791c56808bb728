"""The ports of the servers ``tokenrelay up`` starts: each a port number (1-65535), each
a port of its own, each free before anything starts.

A bad port is refused here, before any process starts, rather than left to the server
that cannot use it: a redis-server given port 0 listens nowhere, a Flower given the web
server's port cannot bind it, and either would be restarted until ``up`` gave up, with a
hint (a damaged Redis file) that does not fit.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from app.settings import Settings
from broker.server import free_port, port_is_free

MAX_PORT = 65535
DEFAULT_REDIS_PORT = 6379


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


@dataclass(frozen=True)
class ServerPort:
    """A port one of the stack's servers will listen on, and how a user chooses it."""

    server: str  # "the web server": as a message names it
    chosen_by: str  # "--port / TOKENRELAY_PORT"
    host: str
    port: int


def server_ports(settings: Settings, redis_port: int | None) -> list[ServerPort]:
    """The ports known before anything starts: the web server's, Flower's and, where
    ``--redis-port`` names one, the private Redis's."""
    ports = [
        ServerPort("the web server", "--port / TOKENRELAY_PORT", settings.host, settings.port),
        ServerPort(
            "Flower", "--flower-port / TOKENRELAY_FLOWER_PORT", "127.0.0.1", settings.flower_port
        ),
    ]
    if redis_port is not None:
        ports.append(ServerPort("Redis", "--redis-port", "127.0.0.1", redis_port))
    return ports


def clash(ports: Sequence[ServerPort]) -> str | None:
    """Why two of ``ports`` cannot both be used (one port given to two servers), if so.

    Refused whatever the hosts: the web server may bind a wildcard address, which
    covers loopback where Flower and Redis listen."""
    first: dict[int, ServerPort] = {}
    for this in ports:
        other = first.setdefault(this.port, this)
        if other is not this:
            return (
                f"{other.chosen_by} and {this.chosen_by} are both {this.port}: "
                f"{other.server} and {this.server} need a port each"
            )
    return None


def busy(
    ports: Sequence[ServerPort], is_free: Callable[[str, int], bool] = port_is_free
) -> str | None:
    """Why ``up`` cannot start (a port another process holds), if so."""
    for this in ports:
        if not is_free(this.host, this.port):
            return (
                f"port {this.port} for {this.server} is in use; choose another with "
                f"{this.chosen_by}"
            )
    return None


def private_redis_port(
    taken: Collection[int],
    is_free: Callable[[str, int], bool] = port_is_free,
    pick: Callable[[], int] = free_port,
) -> int:
    """The private Redis's port when ``--redis-port`` names none: 6379 where it is free,
    else any free port; never one of ``taken`` (the web server's and Flower's, not bound
    yet, so free to a probe, though theirs)."""
    if DEFAULT_REDIS_PORT not in taken and is_free("127.0.0.1", DEFAULT_REDIS_PORT):
        return DEFAULT_REDIS_PORT
    port = pick()
    while port in taken:
        port = pick()
    return port
