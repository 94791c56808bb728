"""``benchmarks/streamer_decode.py`` times the streamer's real decode: every request's
chunk of every timed step becomes an output entry."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmark_modules import load

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load("streamer_decode")


def test_every_request_of_every_step_is_decoded(bench: ModuleType, models_dir: Path) -> None:
    out = bench.measure(models_dir, 4, 30)
    assert out["outputs"] == 4 * 30
    assert 0 < out["step_us_p10"] <= out["step_us_p50"]
