"""``benchmarks/relay.py``'s host pace: one figure per CPU, and the process let go again
(a benchmark that left itself pinned to one CPU would measure a one-core machine); and
``benchmarks/peer.py``'s runs, which carry the share of slow samples too."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tests.benchmark_modules import load


def test_host_pace_is_one_figure_per_cpu_and_restores_the_affinity() -> None:
    relay = load("relay")
    allowed = os.sched_getaffinity(0)
    paces = relay.host_pace_us(reps=1)
    assert len(paces) == len(allowed) and all(p > 0 for p in paces)
    assert os.sched_getaffinity(0) == allowed


@pytest.mark.integration  # starts a process or opens a socket
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


@pytest.mark.integration  # starts a process or opens a socket
def test_the_peer_benchmark_reports_each_run_s_slow_share(monkeypatch: Any) -> None:
    peer = load("peer")

    def fake_stream(base_url: str, body: bytes) -> Any:
        time.sleep(0.15)
        return peer.Sample(ttft=0.05, gaps=[0.01] * 9, tokens=10, chunks=10)

    monkeypatch.setattr(peer, "stream_chat", fake_stream)
    server = peer.Server("tokenrelay", "http://127.0.0.1:1", {"self": os.getpid()})
    run = peer.measure(server, 2, 4, 10, "t")
    assert run.tokens == 40 and run.slow_share is not None and 0 <= run.slow_share <= 1
    assert run.brief()["slow_cpu_share"] == run.slow_share
    table = peer.report([run], [2], ["tokenrelay"])
    assert "slow CPU share" in table.splitlines()[0]
    assert f"| {run.slow_share:.2f} | 0 |" in table.splitlines()[2]
