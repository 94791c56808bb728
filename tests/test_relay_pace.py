"""``benchmarks/relay.py``'s host pace: one figure per CPU, and the process let go again
(a benchmark that left itself pinned to one CPU would measure a one-core machine)."""

from __future__ import annotations

import os
import time

from tests.benchmark_modules import load


def test_host_pace_is_one_figure_per_cpu_and_restores_the_affinity() -> None:
    relay = load("relay")
    allowed = os.sched_getaffinity(0)
    paces = relay.host_pace_us(reps=1)
    assert len(paces) == len(allowed) and all(p > 0 for p in paces)
    assert os.sched_getaffinity(0) == allowed


def test_the_pace_probe_samples_each_cpu_during_its_block() -> None:
    relay = load("relay")
    out: dict[str, list[float]] = {}
    with relay.pace_probe(out):
        time.sleep(0.5)  # ~25 samples, alternating CPUs
    cpus = {f"cpu{cpu}" for cpu in os.sched_getaffinity(0)}
    assert set(out) == cpus | {"slow_share"}
    for cpu in cpus:
        p10, p50, p90 = out[cpu]
        assert 0 < p10 <= p50 <= p90
    assert 0 <= out["slow_share"][0] <= 1
