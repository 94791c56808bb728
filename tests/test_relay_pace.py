"""``benchmarks/relay.py``'s host pace: one figure per CPU, and the process let go again
(a benchmark that left itself pinned to one CPU would measure a one-core machine)."""

from __future__ import annotations

import os

from tests.benchmark_modules import load


def test_host_pace_is_one_figure_per_cpu_and_restores_the_affinity() -> None:
    relay = load("relay")
    allowed = os.sched_getaffinity(0)
    paces = relay.host_pace_us(reps=1)
    assert len(paces) == len(allowed) and all(p > 0 for p in paces)
    assert os.sched_getaffinity(0) == allowed
