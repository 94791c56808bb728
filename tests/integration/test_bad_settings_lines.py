"""Every tokenrelay process started with a bad setting exits 2 with one line saying
which, in the log format the environment asks for: with ``TOKENRELAY_LOG_FORMAT=json``
a JSON log line (so every line a JSON process writes parses, even this one, written
before logging could be configured from the settings), else one text line; never a
traceback. Real processes, started as ``tokenrelay up`` and compose start them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.logs import FIELDS

REPO = Path(__file__).resolve().parents[2]

# kind -> its command (as tests/stack.py and workers/up.py start them)
COMMANDS = {
    "web": ["-m", "web"],
    "worker": ["-m", "workers"],
    "streamer": ["-m", "workers.streamer"],
    "batcher": ["-m", "workers.batcher"],
    "flower": ["-m", "celery", "-A", "broker.flower_app", "flower", "--port=0"],
    "up": ["-m", "workers.up", "--engine", "echo"],
}


def start_with_a_bad_port(kind: str, log_format: str, tmp_path: Path) -> tuple[int, str]:
    return start_with(
        kind, tmp_path, TOKENRELAY_PORT="not-a-port", TOKENRELAY_LOG_FORMAT=log_format
    )


def start_with(kind: str, tmp_path: Path, **variables: str) -> tuple[int, str]:
    """``kind``'s exit status and output, started with ``variables`` on top of this
    environment (its own TOKENRELAY_* and OTEL_* variables left out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENRELAY_", "OTEL_"))}
    env.update(
        **variables,
        TOKENRELAY_MODELS_DIR=str(tmp_path / "models"),
        FLOWER_BASIC_AUTH="user:pass",
        PYTHONPATH=str(REPO),
    )
    args = [sys.executable, *COMMANDS[kind]]
    if kind == "up":
        args += ["--run-dir", str(tmp_path / "run")]
    done = subprocess.run(
        args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    return done.returncode, done.stderr + done.stdout


@pytest.mark.parametrize("kind", sorted(COMMANDS))
def test_a_bad_setting_is_one_json_line(kind: str, tmp_path: Path) -> None:
    code, out = start_with_a_bad_port(kind, "json", tmp_path)
    assert code == 2, out
    lines = [json.loads(line) for line in out.splitlines()]  # every line parses
    assert len(lines) == 1, out
    (line,) = lines
    assert line["level"] == "CRITICAL" and line["process"] == kind
    assert line["message"].startswith("invalid setting TOKENRELAY_PORT: "), line
    assert set(line) <= {"time", "level", "process", "pid", "logger", "message", *FIELDS}


@pytest.mark.parametrize("kind", sorted(COMMANDS))
def test_a_bad_setting_is_one_text_line(kind: str, tmp_path: Path) -> None:
    code, out = start_with_a_bad_port(kind, "text", tmp_path)
    assert code == 2, out
    assert out.startswith(f"tokenrelay {kind}: error: invalid setting TOKENRELAY_PORT: ")
    assert out.count("\n") == 1, out


@pytest.mark.parametrize("kind", ["web", "worker", "streamer", "batcher"])
def test_an_otlp_protocol_it_cannot_export_is_one_line_at_start(kind: str, tmp_path: Path) -> None:
    # Each process sets tracing up as it starts (broker.tracing.start): a protocol it
    # has no exporter for stops it there, as a bad setting does, instead of failing
    # every request's spans once requests come.
    code, out = start_with(
        kind,
        tmp_path,
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/json",
    )
    assert code == 2, out
    assert out == (
        f"tokenrelay {kind}: error: invalid settings: "
        "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported: "
        "use http/protobuf (the default) or grpc\n"
    ), out
