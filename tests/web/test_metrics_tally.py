"""The inter-token latency histogram is tallied per run and added in bulk
(``web.metrics.HistogramTally``): what a scrape sees must be what one ``observe`` per
token would have given, only up to ``TALLY_FLUSH_S`` later."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from web.metrics import _ITL_BUCKETS, TALLY_FLUSH_S, HistogramTally, RunTimer, WebMetrics

# Every bound exactly (observe counts an amount in the first bucket whose bound is >= it),
# just above each, zero, and past the last bound (+Inf).
AMOUNTS = [0.0, *_ITL_BUCKETS, *(b + 1e-9 for b in _ITL_BUCKETS), 3.0, 1e6, 0.0125, 0.0125]


def samples(h: Histogram) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in h.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def pair() -> tuple[Histogram, Histogram]:
    def make() -> Histogram:
        return Histogram("itl", "x", ["m"], buckets=_ITL_BUCKETS, registry=CollectorRegistry())

    return make(), make()


def test_a_flushed_tally_equals_one_observe_per_amount() -> None:
    direct, tallied = pair()
    tally = HistogramTally(tallied.labels("a"))
    for amount in AMOUNTS:
        direct.labels("a").observe(amount)
        tally.observe(amount)
    assert samples(tallied)[("itl_count", (("m", "a"),))] == 0  # nothing before a flush
    tally.flush()
    assert samples(tallied) == samples(direct)
    tally.flush()  # nothing new: adds nothing
    assert samples(tallied) == samples(direct)
    for amount in AMOUNTS[:5]:
        direct.labels("a").observe(amount)
        tally.observe(amount)
    tally.flush()
    assert samples(tallied) == samples(direct)


def test_without_the_bulk_parts_each_amount_is_observed() -> None:
    """A prometheus-client without ``_buckets``/``_sum`` gets one observe per amount."""
    direct, tallied = pair()

    class Plain:
        def __init__(self, child: Histogram) -> None:
            self.observe = child.observe

    tally = HistogramTally(Plain(tallied.labels("a")))  # type: ignore[arg-type]
    for amount in AMOUNTS:
        direct.labels("a").observe(amount)
        tally.observe(amount)
    tally.flush()
    assert samples(tallied) == samples(direct)


@pytest.fixture
def timer_and_clock() -> tuple[RunTimer, WebMetrics, list[float]]:
    now = [100.0]
    metrics = WebMetrics(None)
    timer = RunTimer(metrics, ("m", "/v1/chat/completions", "stream"), clock=lambda: now[0])
    return timer, metrics, now


def itl_count(metrics: WebMetrics) -> float:
    return samples(metrics.itl)[
        (
            "tokenrelay_inter_token_latency_seconds_count",
            (("endpoint", "/v1/chat/completions"), ("mode", "stream"), ("model", "m")),
        )
    ]


def test_run_timer_flushes_its_latencies_every_interval_and_at_the_end(
    timer_and_clock: tuple[RunTimer, WebMetrics, list[float]],
) -> None:
    from broker.run import RunOutcome

    timer, metrics, now = timer_and_clock
    timer.text_sent()  # the first text: time to first token, no gap yet
    for _ in range(5):
        now[0] += 0.01
        timer.text_sent()
    assert itl_count(metrics) == 0  # within the interval: still tallied
    now[0] += TALLY_FLUSH_S
    timer.text_sent()
    assert itl_count(metrics) == 6
    now[0] += 0.01
    timer.text_sent()
    timer.ended(RunOutcome(200, "", None, False))
    assert itl_count(metrics) == 7
    timer.ended(RunOutcome(200, "", None, False))  # once
    assert itl_count(metrics) == 7
