"""``benchmarks/device_carry.py`` (what travels to the device machine) and
``benchmarks/relay_summary.py`` (what its log says)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmark_modules import load


@pytest.fixture(scope="module")
def carry() -> Iterator[ModuleType]:
    yield load("device_carry")


@pytest.fixture(scope="module")
def summary() -> Iterator[ModuleType]:
    yield load("relay_summary")


# A made-up distribution graph: markers on the Python's patch level and on extras, an
# extra that pulls more, a cycle, a skipped package with a dependency of its own.
GRAPH: dict[str, list[str]] = {
    "root": [
        "Web_App>=1",
        "broker[fast]",
        "old-backport; python_version < '3.11'",
        "patch-fix; python_full_version < '3.12.5'",
        "numpy>=1.26",
        "tests-only; extra == 'dev'",
    ],
    "web-app": ["markup", "broker"],
    "broker": ["vine", "hiredis; extra == 'fast'", "windows-only; sys_platform == 'win32'"],
    "vine": ["broker"],  # a cycle
    "hiredis": [],
    "markup": [],
    "numpy": ["numpy-only-dep"],
    "patch-fix": [],
}


def test_closure_follows_extras_and_markers_for_the_target_python(carry: ModuleType) -> None:
    names = carry.closure("root", GRAPH.get, python="3.12.3", skip=["NumPy"])
    assert names == ["broker", "hiredis", "markup", "patch-fix", "vine", "web-app"]


def test_closure_evaluates_the_patch_level_and_the_minor_version(carry: ModuleType) -> None:
    newer = carry.closure("root", GRAPH.get, python="3.12.7", skip=["numpy"])
    assert "patch-fix" not in newer
    older = carry.closure("root", GRAPH.get, python="3.10.4", skip=[])
    assert {"old-backport", "patch-fix", "numpy", "numpy-only-dep"} <= set(older)
    assert "tests-only" not in older and "windows-only" not in older


def test_closure_of_a_distribution_without_metadata_is_its_name_alone(
    carry: ModuleType,
) -> None:
    assert carry.closure("root", {"root": ["ghost"]}.get, python="3.12.3") == ["ghost"]


def test_the_platform_tags_reach_the_glibc_llguidance_needs(carry: ModuleType) -> None:
    # llguidance 1.9's only Linux wheel is manylinux_2_31: without it pip finds 1.6.
    assert "manylinux_2_31_x86_64" in carry.PLATFORMS
    assert len(set(carry.PLATFORMS)) == len(carry.PLATFORMS)


RELAY_RUN = {
    "stage": "relay",
    "streamers": 1,
    "reader": "pump",
    "engine_rate_per_request": 200.0,
    "requests": 64,
    "tokens_per_s": 9913,
    "cpu_us_per_token": {"worker": 43.3, "redis": 21.4, "streamer": 38.5},
    "cpu_us_per_token_total": 103.1,
    "redis_calls_per_token": {"evalsha": 0.042},
    "added_latency_ms": {"ttft_p50": 11.3, "ttft_p99": 154.3, "itl_p50": 4.86, "itl_p99": 55.0},
    "keep_up_in_run": 0.999,
    "host_pace_us": {"before": [510.0], "after": [520.0], "in_run": {"slow_share": [0.25]}},
}
WORKER_RUN = {
    "stage": "worker",
    "streamers": 0,
    "engine_rate_per_request": "unlimited",
    "tokens_per_s": 20656,
    "cpu_us_per_token": {"worker": 26.2, "redis": 13.1},
    "cpu_us_per_token_total": 39.4,
}
FLOOR_RUN = {
    "variant": "design",
    "requests": 64,
    "steps": 256,
    "rate": 200.0,
    "lines": 16384,
    "cpu_us_per_line": {"reader": 6.7, "relay": 15.9, "publisher": 12.2, "redis": 16.5},
    "script_us_per_call": 400.0,
    "itl_p50_ms": 2.56,
    "itl_p90_ms": 3.0,
}
KEEP_UP = {
    "keep_up_vs_worker_only": [1.349],
    "keep_up_vs_worker_only_median": 1.349,
    "keep_up_in_run": [0.999],
    "keep_up_in_run_median": 0.999,
}


def test_summary_reads_indented_runs_between_log_lines(summary: ModuleType, tmp_path: Path) -> None:
    text = (
        "warning: something on stderr {not json}\n"
        + json.dumps(WORKER_RUN, indent=2)
        + "\n"
        + json.dumps(RELAY_RUN, indent=2)
        + "\n[1, 2]\n"
        + json.dumps(KEEP_UP, indent=2)
    )
    runs = list(summary.objects(text))
    assert runs == [WORKER_RUN, RELAY_RUN, KEEP_UP]
    lines = [summary.line(r) for r in runs]
    assert lines[0].startswith("worker - str -       max   20656 tok/s  CPU µs/token 39.4")
    assert lines[1].startswith("relay  1 str pump  200/s    9913 tok/s  CPU µs/token 103.1")
    assert "added ITL p50 4.86 ms  p99 55.00 ms  keep-up in run 0.999  slow CPU 25%" in lines[1]
    assert "slow CPU" not in lines[0]
    assert lines[2] == "keep-up vs worker-only [1.349] (median 1.349), in run 0.999"


def test_summary_of_a_floor_run_and_of_what_is_not_a_run(summary: ModuleType) -> None:
    text = summary.line(FLOOR_RUN)
    assert text.startswith("floor design  64 req  200/s  ITL p50 2.56 ms  p90 3.00 ms")
    assert "CPU µs/line 51.3 (reader 6.7, relay 15.9, publisher 12.2, redis 16.5)" in text
    assert summary.line({"status": "ok"}) is None


def test_summary_command_prints_each_file_s_runs(
    summary: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    floor = tmp_path / "floor.json"
    floor.write_text(json.dumps(FLOOR_RUN) + "\n" + json.dumps({**FLOOR_RUN, "variant": "hops"}))
    assert summary.main([str(floor)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"# {floor}"
    assert [x.split()[1] for x in out[1:]] == ["design", "hops"]
    assert summary.main([str(tmp_path / "missing.json")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "(no such file)"
    assert summary.main([]) == 2


def test_the_gguf_is_split_to_fill_the_first_call_and_refused_when_it_cannot_fit(
    carry: ModuleType, tmp_path: Path
) -> None:
    big = tmp_path / "model.gguf"
    data = bytes(range(256)) * 40  # 10,240 bytes
    big.write_bytes(data)
    a, b = tmp_path / "part.aa", tmp_path / "part.ab"
    assert carry.split_to_fit(big, a, b, first_room=6000, second_room=5000) == (6000, 4240)
    assert a.read_bytes() + b.read_bytes() == data  # what `cat` joins there
    with pytest.raises(SystemExit, match="does not fit two calls"):
        carry.split_to_fit(big, a, b, first_room=6000, second_room=4000)
    # No room left in the first call after the wheels: all of it in the second.
    assert carry.split_to_fit(big, a, b, first_room=-5, second_room=20000) == (0, 10240)


@pytest.mark.integration  # runs git
def test_the_working_tree_that_travels_counts_untracked_files_but_not_ignored_ones(
    carry: ModuleType, tmp_path: Path
) -> None:
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")  # 9 bytes
    (tmp_path / "kept.txt").write_bytes(b"x" * 100)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_bytes(b"y" * 5000)
    assert carry.tree_bytes(tmp_path) == 109
    # The real tree: what each GPU call carries beside its part (checked by size).
    repo = Path(__file__).resolve().parent.parent
    assert carry.tree_bytes(repo) < 8 * 2**20
    gguf_and_wheels = 94 * 2**20 + 22 * 2**20  # the bundled GGUF, the staged wheels
    room = carry.CALL_LIMIT - carry.MARGIN - carry.tree_bytes(repo)
    assert gguf_and_wheels <= 2 * room
