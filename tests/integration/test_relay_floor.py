"""``benchmarks/relay_floor.py`` runs: every line crosses its three processes, through
the production scripts (``design``) and through plain step entries (``hops``)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.benchmark_modules import load

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def floor() -> ModuleType:
    return load("relay_floor")


@pytest.mark.parametrize("variant", ["design", "hops"])
def test_every_line_crosses_the_three_processes(floor: ModuleType, variant: str) -> None:
    out = floor.run(4, 12, 400.0, variant)
    assert out["lines"] == 4 * 12
    assert 0 < out["itl_p50_ms"] <= out["itl_p90_ms"]
