"""Suite times: whether any test got slower, from pytest's JUnit XML of whole-suite runs.

    pytest --junitxml base.xml    # in a checkout of the base commit
    pytest --junitxml head.xml    # in this one, alternated: base, head, base, ...
    python benchmarks/suite_times.py --base base1.xml base2.xml --head head1.xml head2.xml

Why: issue 12 asks that no test get slower by more than 10 % overall. One whole-suite
run takes 15-20 minutes here, and the same code has taken 840 s and 933 s in two runs
an hour apart, so one pair of totals cannot answer it: tests were added, renamed and
removed in between, and the host's speed moves. This compares only the tests that
passed in every run given, per run, so each side's total is over the same tests; with
several runs a side, the spread of one side is the noise the difference must beat.
"""

from __future__ import annotations

import argparse
import statistics
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

TestId = tuple[str, str]  # (classname, name)


def passed_durations(path: Path) -> dict[TestId, float]:
    """Seconds each test took in one run, for the tests that passed (a failure, an error
    or a skip says nothing about how long the test takes)."""
    out: dict[TestId, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if any(child.tag in ("failure", "error", "skipped") for child in case):
            continue
        out[(case.get("classname", ""), case.get("name", ""))] = float(case.get("time", "0"))
    return out


def group_of(test: TestId) -> str:
    """The test's top folder or module under tests/ (``e2e``, ``faults``, ``test_cli``)."""
    parts = test[0].split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tests" else parts[0]


@dataclass
class Comparison:
    """Totals over the tests that passed in every run (seconds)."""

    tests: int
    base_runs_s: list[float]
    head_runs_s: list[float]
    by_group: dict[str, tuple[int, float, float]]  # group -> (tests, base mean, head mean)
    grew_most: list[tuple[str, float, float]]  # (test, base mean, head mean)

    @property
    def head_over_base(self) -> float:
        return statistics.fmean(self.head_runs_s) / statistics.fmean(self.base_runs_s)


def compare(base: list[dict[TestId, float]], head: list[dict[TestId, float]]) -> Comparison:
    """Each run's total over the tests every run passed, the same by group, and the
    tests whose mean time grew the most."""
    common = set.intersection(*(set(run) for run in (*base, *head)))

    def mean(runs: list[dict[TestId, float]], tests: set[TestId]) -> float:
        return statistics.fmean(sum(run[t] for t in tests) for run in runs)

    groups: dict[str, set[TestId]] = defaultdict(set)
    for t in common:
        groups[group_of(t)].add(t)
    by_group = {
        g: (len(tests), mean(base, tests), mean(head, tests))
        for g, tests in sorted(groups.items(), key=lambda kv: -mean(base, kv[1]))
    }
    grew = sorted(common, key=lambda t: mean(base, {t}) - mean(head, {t}))[:10]
    return Comparison(
        tests=len(common),
        base_runs_s=[sum(run[t] for t in common) for run in base],
        head_runs_s=[sum(run[t] for t in common) for run in head],
        by_group=by_group,
        grew_most=[(f"{t[0]}::{t[1]}", mean(base, {t}), mean(head, {t})) for t in grew],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, nargs="+", required=True, help="JUnit XML files")
    parser.add_argument("--head", type=Path, nargs="+", required=True, help="JUnit XML files")
    args = parser.parse_args(argv)
    c = compare([passed_durations(p) for p in args.base], [passed_durations(p) for p in args.head])
    print(f"tests passed in every run: {c.tests}")
    print(f"base runs (s): {[round(x) for x in c.base_runs_s]}")
    print(f"head runs (s): {[round(x) for x in c.head_runs_s]}")
    print(f"head / base (means): {c.head_over_base:.3f}x")
    print("| group | tests | base s | head s | head / base |\n|---|---|---|---|---|")
    for g, (n, b, h) in c.by_group.items():
        if b < 1.0 and h < 1.0:
            continue  # the unit tests' groups: milliseconds each
        print(f"| {g} | {n} | {b:.1f} | {h:.1f} | {h / b if b else float('nan'):.2f}x |")
    print("grew most (mean s, base -> head):")
    for test, b, h in c.grew_most:
        print(f"  {b:6.2f} -> {h:6.2f}  {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
