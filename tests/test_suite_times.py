"""``benchmarks/suite_times.py``: totals over the tests that passed in every run only."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmark_modules import load


@pytest.fixture(scope="module")
def suite_times() -> ModuleType:
    return load("suite_times")


def junit(path: Path, cases: dict[str, tuple[float, str]]) -> Path:
    """A JUnit file with ``name -> (seconds, outcome)``; classname from the name's prefix."""
    body = []
    for name, (secs, outcome) in cases.items():
        cls, _, test = name.rpartition("::")
        inner = "" if outcome == "passed" else f"<{outcome} message='x'/>"
        body.append(f'<testcase classname="{cls}" name="{test}" time="{secs}">{inner}</testcase>')
    path.write_text(f"<testsuites><testsuite>{''.join(body)}</testsuite></testsuites>")
    return path


def test_only_tests_that_passed_in_every_run_count(suite_times: ModuleType, tmp_path: Path) -> None:
    base = junit(
        tmp_path / "base.xml",
        {
            "tests.e2e.test_a::test_x": (10.0, "passed"),
            "tests.test_cli::test_y": (2.0, "passed"),
            "tests.faults.test_b::test_gone": (50.0, "passed"),  # removed since
            "tests.e2e.test_a::test_flaky": (1.0, "failure"),
        },
    )
    head = junit(
        tmp_path / "head.xml",
        {
            "tests.e2e.test_a::test_x": (12.0, "passed"),
            "tests.test_cli::test_y": (2.0, "passed"),
            "tests.e2e.test_a::test_flaky": (30.0, "passed"),
            "tests.web.test_new::test_z": (99.0, "passed"),  # added since
            "tests.web.test_new::test_skip": (0.0, "skipped"),
        },
    )
    durations = suite_times.passed_durations
    c = suite_times.compare([durations(base)], [durations(head)])
    assert c.tests == 2
    assert (c.base_runs_s, c.head_runs_s) == ([12.0], [14.0])
    assert c.head_over_base == pytest.approx(14.0 / 12.0)
    assert c.by_group == {"e2e": (1, 10.0, 12.0), "test_cli": (1, 2.0, 2.0)}
    assert c.grew_most[0] == ("tests.e2e.test_a::test_x", 10.0, 12.0)


def test_several_runs_a_side_are_averaged(suite_times: ModuleType, tmp_path: Path) -> None:
    runs = [
        suite_times.passed_durations(
            junit(tmp_path / f"{i}.xml", {"tests.test_m::t": (s, "passed")})
        )
        for i, s in enumerate([8.0, 10.0, 9.0, 11.0])
    ]
    c = suite_times.compare(runs[:2], runs[2:])
    assert c.head_over_base == pytest.approx(10.0 / 9.0)
    argv = ["--base", str(tmp_path / "0.xml"), "--head", str(tmp_path / "2.xml")]
    assert suite_times.main(argv) == 0
