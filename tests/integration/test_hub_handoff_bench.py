"""``benchmarks/hub_handoff.py`` times the output hub's real hand-off: every line of
every timed step reaches its subscription's pump."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.benchmark_modules import load

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load("hub_handoff")


def test_every_line_of_every_step_is_handed(bench: ModuleType) -> None:
    out = bench.measure(4, 30)  # raises if a step's lines were not all taken
    assert 0 < out["first_line_us_p10"] <= out["all_lines_us_p50"]
    assert out["all_lines_us_p10"] <= out["all_lines_us_p50"]
