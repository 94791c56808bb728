"""workers.backoff.Backoff: the pause grows and is capped, an outage is reported once
when it starts and once when it ends."""

from __future__ import annotations

from workers.backoff import Backoff


def test_delay_doubles_up_to_the_cap_and_resets() -> None:
    b = Backoff(initial_s=0.1, max_s=1.0)
    assert b.ready(0.0) and not b.failing
    delays = []
    for i in range(6):
        b.failed(float(i))
        delays.append(b.delay_s)
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert not b.ready(5.5) and b.ready(6.0)
    assert b.recovered() and not b.failing and b.ready(6.0)
    b.failed(10.0)
    assert b.delay_s == 0.1


def test_an_outage_is_reported_once_each_way() -> None:
    b = Backoff()
    assert [b.failed(float(t)) for t in range(5)] == [True, False, False, False, False]
    assert b.since == 0.0
    assert b.recovered() is True
    assert b.recovered() is False


def test_a_very_long_outage_does_not_overflow() -> None:
    b = Backoff(initial_s=0.1, max_s=2.0)
    for t in range(5000):
        b.failed(float(t))
    assert b.delay_s == 2.0
