"""The prepared GPU run, whole, in its dry run (issue 40): every phase of
``benchmarks/gpu_check.py`` as the device would run it, with exllamav2's stand-in
generator driven by transformers on the CPU, so that the device's one call cannot fail
on a mistake in the script. Real: the GGUF conversion, transformers, the engine's
mapping, redis-server, the Celery worker and the streamer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import bundled_gguf

pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
PHASES = ["convert", "reference", "compile", "unpaged", "paged", "worker"]


def test_the_dry_run_passes_every_phase_and_writes_each_result(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--dry-run",
            "--out",
            str(out),
            "--gguf",
            str(bundled_gguf()),
            "--work-dir",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.glob("0*.json"))
    assert files == [f"{i:02d}-{name}.json" for i, name in enumerate(PHASES, 1)]
    results = {
        json.loads(p.read_text())["phase"]: json.loads(p.read_text()) for p in out.glob("0*")
    }
    assert all(r["ok"] and r["started"] <= r["ended"] for r in results.values())
    unpaged, paged, worker = results["unpaged"], results["paged"], results["worker"]
    assert unpaged["ids_equal"] and unpaged["segments"]["ids_equal"]
    assert set(unpaged["paths"]) == {"logit_bias", "stop_token", "cancel", "logprobs", "penalties"}
    assert unpaged["paths"]["logprobs"]["max_logprob_error"] < 1e-3
    assert paged["engine"]["max_active"] == 4 and paged["ids_equal"]
    assert worker["texts_equal_raw"] and worker["tokens"] == 4 * 10
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["figures"]["paged_max_active"] == 4
