"""``tokenrelay up`` as a user runs it: the whole stack (echo engine), real clients, then
SIGTERM; a child that dies is reported and brings the rest down; it stops only what it
started."""

from __future__ import annotations

import base64
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from broker.server import RedisServer, free_port
from tests.upstack import UpRun, pid_alive, up_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"


def start_up(tmp_path: Path, models_dir: Path, *extra: str, **env: str) -> UpRun:
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "workers.up",
        "--engine",
        "echo",
        "--run-dir",
        str(run_dir),
        "--port",
        str(free_port()),
        "--flower-port",
        str(free_port()),
        *extra,
    ]
    return UpRun(
        args, up_env(TOKENRELAY_MODELS_DIR=str(models_dir), **env), run_dir, tmp_path / "up.out"
    )


@pytest.fixture
def up(tmp_path: Path, models_dir: Path) -> Iterator[UpRun]:
    run = start_up(tmp_path, models_dir, "--redis-port", str(free_port()))
    try:
        yield run
    finally:
        run.cleanup()


def get(url: str, auth: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_up_serves_the_stack_and_stops_everything_on_sigterm(up: UpRun) -> None:
    state = up.wait_ready(120)
    urls = state["urls"]
    pids = up.recorded_pids()
    assert {"redis", "worker", "streamer", "web", "flower", "up"} <= set(pids)

    status, page = get(urls["chat"])
    assert status == 200 and b"<html" in page.lower()
    client = openai.OpenAI(base_url=urls["api"], api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello relay"}], max_tokens=16
    )
    assert reply.choices[0].message.content == "hello relay"  # echo: the last user message
    streamed = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "one two"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "one two"

    # Flower runs with the basic auth that was printed, and enforces it.
    auth = up.flower_auth()
    assert get(urls["flower"] + "api/workers", auth)[0] == 200
    assert get(urls["flower"] + "api/workers", "admin:wrong")[0] == 401

    up.popen.send_signal(signal.SIGTERM)
    assert up.wait_exit(60) == 0, up.logs()
    alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
    assert not alive, f"left running: {alive}"
    final = up.state()
    assert final["state"] == "stopped" and final["exit_code"] == 0


def test_a_dead_child_is_reported_and_the_rest_stopped(
    tmp_path: Path, models_dir: Path, redis_server: RedisServer
) -> None:
    # Also: with TOKENRELAY_REDIS_URL set, `up` uses that Redis, starts none, and leaves
    # it running (it stops only what it started).
    run = start_up(tmp_path, models_dir, TOKENRELAY_REDIS_URL=redis_server.url)
    try:
        run.wait_ready(120)
        pids = run.recorded_pids()
        assert "redis" not in pids
        streamer = pids["streamer"]
        os.kill(streamer, signal.SIGKILL)
        code = run.wait_exit(60)
        assert code != 0
        out = run.output()
        assert f"streamer (pid {streamer}) exited unexpectedly (killed by SIGKILL)" in out, out
        assert "streamer.log" in out
        alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
        assert not alive, f"left running: {alive}"
        assert run.state()["exit_code"] == code
        assert redis_server.proc is not None and redis_server.proc.poll() is None
    finally:
        run.cleanup()


def test_a_busy_port_fails_fast_and_starts_nothing(tmp_path: Path, models_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run_dir = tmp_path / "run"
        run = UpRun(
            [sys.executable, "-m", "workers.up", "--engine", "echo", "--run-dir", str(run_dir)],
            up_env(TOKENRELAY_MODELS_DIR=str(models_dir), TOKENRELAY_PORT=str(port)),
            run_dir,
            tmp_path / "up.out",
        )
        started = time.monotonic()
        try:
            assert run.wait_exit(60) == 1
        finally:
            run.cleanup()
    assert f"port {port} for the web server is in use" in run.output()
    assert time.monotonic() - started < 30
    assert not run.state().get("children")
