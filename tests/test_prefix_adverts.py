"""When a worker writes its cached prefixes and load (workers.prefix_adverts): a fake
engine and clock, the writes recorded."""

from __future__ import annotations

from typing import Any

import redis

from workers.prefix_adverts import EVERY_S, REFRESH_S, PrefixAdvertiser


class Engine:
    def __init__(self) -> None:
        self.names: frozenset[bytes] | None = frozenset({b"a"})
        self.asked = 0

    def prefix_blocks(self) -> frozenset[bytes] | None:
        self.asked += 1
        return self.names


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[PrefixAdvertiser, Engine, Clock, list[tuple[Any, ...]]]:
    writes: list[tuple[Any, ...]] = []
    clock = Clock()
    adv = PrefixAdvertiser(lambda *a: writes.append(a), clock=clock)
    return adv, Engine(), clock, writes


def test_the_first_write_is_whole_then_only_changes() -> None:
    adv, engine, _clock, writes = make()
    adv.tick(engine, False, 0)  # type: ignore[arg-type]
    assert writes == [(frozenset({b"a"}), None, 0)]
    adv.tick(engine, False, 0)  # type: ignore[arg-type]
    assert len(writes) == 1  # nothing changed, and the names were not even asked for
    assert engine.asked == 1
    adv.tick(engine, False, 2)  # type: ignore[arg-type]
    assert writes[-1] == (frozenset({b"a"}), frozenset({b"a"}), 2)  # the load alone


def test_a_finished_choice_is_advertised_at_once_other_changes_each_second() -> None:
    adv, engine, clock, writes = make()
    adv.tick(engine, False, 0)  # type: ignore[arg-type]
    engine.names = frozenset({b"a", b"b"})
    adv.tick(engine, False, 0)  # type: ignore[arg-type]
    assert len(writes) == 1  # not looked at again within EVERY_S
    adv.tick(engine, True, 0)  # type: ignore[arg-type]
    assert writes[-1] == (frozenset({b"a", b"b"}), frozenset({b"a"}), 0)
    engine.names = frozenset({b"b"})
    clock.now += EVERY_S
    adv.tick(engine, False, 0)  # type: ignore[arg-type]
    assert writes[-1] == (frozenset({b"b"}), frozenset({b"a", b"b"}), 0)


def test_a_failed_write_and_a_long_quiet_rewrite_everything() -> None:
    adv, engine, clock, writes = make()
    adv.tick(engine, False, 0)  # type: ignore[arg-type]

    def fail(*_: Any) -> None:
        raise redis.ConnectionError("away")

    adv.write = fail
    adv.tick(engine, True, 1)  # type: ignore[arg-type]
    adv.write = lambda *a: writes.append(a)
    adv.tick(engine, False, 1)  # type: ignore[arg-type]
    assert writes[-1] == (frozenset({b"a"}), None, 1)  # Redis may have lost it: whole
    clock.now += REFRESH_S
    adv.tick(engine, False, 1)  # type: ignore[arg-type]
    assert writes[-1] == (frozenset({b"a"}), None, 1)  # refreshed whole, unchanged


def test_an_engine_without_a_prefix_cache_is_never_advertised() -> None:
    adv, engine, _clock, writes = make()
    engine.names = None
    adv.tick(engine, True, 3)  # type: ignore[arg-type]
    assert writes == []
