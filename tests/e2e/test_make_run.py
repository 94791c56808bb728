"""The issue's acceptance for the one-command local run: ``make run`` in the background
serves the chat page and answers an ``openai`` SDK chat request with the bundled model
(llama.cpp engine), then stops cleanly on SIGTERM with no process left.

In CI, ``make test`` has already built the virtualenv, so ``make run``'s install step is
a no-op here and what runs is exactly what a user's ``make run`` runs.
"""

from __future__ import annotations

import shutil
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from broker.server import free_port
from tests.upstack import UpRun, pid_alive, up_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_serves_the_bundled_model_and_stops_cleanly(
    tmp_path: Path, sdk_client: Callable[..., openai.OpenAI]
) -> None:
    pytest.importorskip("llama_cpp", reason="the cpu extra (llama-cpp-python) is not installed")
    run_dir = tmp_path / "run"
    up_args = f"--run-dir {run_dir} --redis-port {free_port()}"
    run = UpRun(
        ["make", "--no-print-directory", "run", f"UP_ARGS={up_args}"],
        # A fresh models dir: `up` prepares the bundled model itself on first use.
        up_env(
            TOKENRELAY_PORT=str(free_port()),
            TOKENRELAY_FLOWER_PORT=str(free_port()),
            TOKENRELAY_MODELS_DIR=str(tmp_path / "models"),
        ),
        run_dir,
        tmp_path / "make-run.out",
    )
    try:
        state = run.wait_ready(300)
        urls = state["urls"]
        pids = run.recorded_pids()
        assert {"redis", "worker", "streamer", "web", "flower", "up"} <= set(pids)

        with urllib.request.urlopen(urls["chat"], timeout=10) as page:
            assert page.status == 200
            assert b"<html" in page.read().lower()

        client = sdk_client(urls["api"], timeout=120)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        choice = reply.choices[0]
        assert choice.message.content and choice.message.content.strip(), reply
        assert choice.finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        assert "engine llamacpp" in run.output()

        # SIGTERM to make, as a service manager or a CI job would send it: make passes
        # it on to `tokenrelay up`, which stops everything it started.
        run.popen.send_signal(signal.SIGTERM)
        run.wait_exit(90)
        alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
        assert not alive, f"left running: {alive}\n{run.logs()}"
        final = run.state()
        assert final["state"] == "stopped" and final["exit_code"] == 0, run.logs()
    finally:
        run.cleanup()
