"""``benchmarks/relay_floor.py`` measures what it says it measures.

Its ``steps-only`` variant edits the production output-write script by text to project
a design change (docs/benchmarks.md). If that script changes, the edit must fail loudly
rather than measure something else, and the edited script must still fence and write
the step stream: only the per-request entries go.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def floor() -> ModuleType:
    saved = list(sys.path)  # the benchmark adds its folders too: none may outlive this
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import relay_floor
    finally:
        sys.path[:] = saved
    return relay_floor


@pytest.mark.parametrize("variant", ["design", "steps-only", "hops"])
def test_every_line_crosses_the_three_processes(floor: ModuleType, variant: str) -> None:
    out = floor.run(4, 12, 400.0, variant)
    assert out["lines"] == 4 * 12
    assert 0 < out["itl_p50_ms"] <= out["itl_p90_ms"]


def test_steps_only_write_keeps_the_step_entry_and_drops_the_output_entries(
    floor: ModuleType,
) -> None:
    assert "XADD', KEYS[i]" not in floor.STEPS_ONLY_WRITE
    assert "'XLEN'" not in floor.STEPS_ONLY_WRITE
    assert "XPENDING" in floor.STEPS_ONLY_WRITE  # the fence stays
    assert "redis.call('XADD', steps" in floor.STEPS_ONLY_WRITE
