"""``workers.up_ports``: the stack's ports, one per server, free before anything starts
(probes passed in: a unit test opens no socket)."""

from __future__ import annotations

from collections.abc import Iterator

from app.settings import Settings
from workers.up_ports import busy, clash, private_redis_port, server_ports


def test_ports_of_their_own_do_not_clash() -> None:
    assert clash(server_ports(Settings(port=8901, flower_port=5901), 6901)) is None


def test_one_port_for_two_servers_names_both_and_how_each_was_chosen() -> None:
    ports = server_ports(Settings(port=8901, flower_port=5901), 8901)
    assert clash(ports) == (
        "--port / TOKENRELAY_PORT and --redis-port are both 8901: "
        "the web server and Redis need a port each"
    )


def test_a_busy_port_names_its_server_and_option() -> None:
    ports = server_ports(Settings(port=8901, flower_port=5901), 6901)
    assert busy(ports, is_free=lambda _host, _port: True) is None
    assert busy(ports, is_free=lambda _host, port: port != 5901) == (
        "port 5901 for Flower is in use; choose another with --flower-port / TOKENRELAY_FLOWER_PORT"
    )


def test_the_private_redis_never_takes_the_web_servers_or_flowers_port() -> None:
    """``up --port 6379``: 6379 is free to a probe until the web server binds it."""
    picks: Iterator[int] = iter([5901, 8901, 6902])

    def always_free(_host: str, _port: int) -> bool:
        return True

    assert private_redis_port({8901, 5901}, always_free, lambda: next(picks)) == 6379
    assert private_redis_port({6379, 5901}, always_free, lambda: next(picks)) == 8901
    assert private_redis_port({6379, 8901}, lambda _h, _p: False, lambda: next(picks)) == 6902
