"""``TOKENRELAY_LOG_FORMAT=json`` across a whole stack of real processes (issue 45): a
worker, a streamer, the batch driver, the web server (with its access log) and Flower,
with API keys on (two environment keys and a managed one made over the admin API).

A few requests (streamed and not, one with a wrong key, one with a key in its query
string, one batch), then the stack stops, and every line every process wrote, from its
start to its shutdown, must be one JSON object with the fields of ``app.logs``; request
ids and key ids appear where they are known; and no key, no key's hash and no prompt
appears in any log.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from app.logs import FIELDS
from broker.api_keys import secret_hash
from broker.server import free_port
from tests.stack import (
    Proc,
    Stack,
    child_env,
    flower_process,
    full_stack,
    isolated_settings,
    wait_for,
)

pytestmark = pytest.mark.e2e

ADMIN = "json-logs-admin-key-0123456789"
USER = "json-logs-user-key-abcdefghijk"
WRONG = "json-logs-wrong-key-zyxwvutsrq"
PROMPT = "Zebras-7421 never appear in a log"
ISO_MS_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
KIND_OF_LOG = {"worker": "worker", "streamer": "streamer", "batcher": "batcher",
               "web": "web", "flower": "flower"}  # fmt: skip


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextmanager
def logged_web(stack: Stack) -> Iterator[Proc]:
    """``tokenrelay web --access-log`` on the stack's address (one access line a
    request, carrying its request id and key id)."""
    metrics = stack.log_dir / "web-metrics"
    metrics.mkdir(exist_ok=True)
    env = child_env(stack.settings, PROMETHEUS_MULTIPROC_DIR=str(metrics))
    with Proc([sys.executable, "-m", "web", "--access-log"], env, stack.log_dir / "web.log") as p:

        def healthy() -> bool:
            assert p.alive(), p.output()
            try:
                return requests.get(f"{stack.base_url}/health", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(healthy, 30, "the web server", interval=0.2)
        yield p


def chat(stack: Stack, key: str, **extra: Any) -> requests.Response:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, **extra}
    return requests.post(
        f"{stack.base_url}/v1/chat/completions", json=body, headers=bearer(key), timeout=30
    )


def run_a_batch(stack: Stack, key: str) -> None:
    line = {
        "custom_id": "one",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": stack.settings.served_name, "max_tokens": 8,
                 "messages": [{"role": "user", "content": PROMPT}]},
    }  # fmt: skip
    up = requests.post(
        f"{stack.base_url}/v1/files",
        files={"file": ("in.jsonl", json.dumps(line).encode())},
        data={"purpose": "batch"},
        headers=bearer(key),
        timeout=10,
    )
    assert up.status_code == 200, up.text
    made = requests.post(
        f"{stack.base_url}/v1/batches",
        json={"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
              "completion_window": "24h"},
        headers=bearer(key),
        timeout=10,
    )  # fmt: skip
    assert made.status_code == 200, made.text
    url = f"{stack.base_url}/v1/batches/{made.json()['id']}"

    def done() -> bool:
        status = requests.get(url, headers=bearer(key), timeout=5).json()["status"]
        assert status not in ("failed", "cancelled", "expired"), status
        return status == "completed"

    wait_for(done, 30, "the batch to complete", interval=0.2)


def parsed(path: Path) -> list[dict[str, Any]]:
    """Every line of ``path`` as JSON; fails naming the first line that is not."""
    out = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            obj = json.loads(line)
        except ValueError:
            pytest.fail(f"{path.name}:{n} is not JSON: {line!r}")
        assert isinstance(obj, dict), f"{path.name}:{n}: {line!r}"
        out.append(obj)
    return out


def test_every_process_logs_json_lines_and_never_a_key(models_dir: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        api_keys=[ADMIN, USER],
        admin_api_keys=[ADMIN],
        log_format="json",
        web_workers=1,
        web_threads=8,
    )
    log_dir = tmp_path / "logs"
    flower_auth = f"admin:{uuid.uuid4().hex}"
    with full_stack(settings, log_dir, batcher=True, web=None) as stack:
        stack.start("web", logged_web(stack))
        flower_port = free_port()
        stack.start("flower", flower_process(stack.settings, log_dir, flower_port, flower_auth))
        made = requests.post(
            f"{stack.base_url}/admin/keys", json={"name": "logs"}, headers=bearer(ADMIN), timeout=10
        )
        assert made.status_code == 201, made.text
        managed_id, managed = made.json()["id"], made.json()["secret"]

        with requests.post(
            f"{stack.base_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": PROMPT}], "stream": True},
            headers=bearer(USER),
            stream=True,
            timeout=30,
        ) as streamed:
            assert streamed.status_code == 200
            assert b"data: [DONE]" in b"".join(streamed.iter_content(None))
        assert chat(stack, managed).status_code == 200
        assert chat(stack, WRONG).status_code == 401
        # A key in the query string (as a WebSocket may send it) stays out of the access log.
        listed = requests.get(
            f"{stack.base_url}/v1/models?api_key={managed}", headers=bearer(managed), timeout=10
        )
        assert listed.status_code == 200
        run_a_batch(stack, USER)

        def flower_up() -> bool:
            try:
                url = f"http://127.0.0.1:{flower_port}/healthcheck"
                auth = tuple(flower_auth.split(":", 1))
                return requests.get(url, auth=auth, timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(flower_up, 30, "Flower", interval=0.2)
        logs_seen = stack.logs()
    # Stopped: every line up to each process's shutdown is in its log.

    files = sorted(log_dir.glob("*.log"))
    kinds = {next(k for p, k in KIND_OF_LOG.items() if f.name.startswith(p)): f for f in files}
    assert set(kinds) == set(KIND_OF_LOG.values()), [f.name for f in files]
    every: list[dict[str, Any]] = []
    for kind, path in kinds.items():
        lines = parsed(path)
        assert lines, f"{path.name} is empty"
        for line in lines:
            assert ISO_MS_UTC.match(line["time"]), line
            assert line["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), line
            assert line["process"] == kind and isinstance(line["pid"], int), line
            assert isinstance(line["logger"], str) and isinstance(line["message"], str), line
            assert all(line[f] for f in FIELDS if f in line), line  # empty ones are left out
        every += lines

    assert any(line.get("request_id") for line in every), logs_seen
    web_keys = {line.get("key_id") for line in every if line["process"] == "web"}
    assert {managed_id, f"env-{secret_hash(USER)[:8]}"} <= web_keys, web_keys

    text = "\n".join(path.read_text(errors="replace") for path in files)
    secrets = {
        "admin key": ADMIN,
        "user key": USER,
        "wrong key": WRONG,
        "managed key": managed,
        "its secret part": managed.removeprefix("sk-tr-"),
        "flower password": flower_auth.split(":", 1)[1],
        "a key's hash": secret_hash(USER),
        "the managed key's hash": secret_hash(managed),
        "the prompt": PROMPT,
    }
    found = [what for what, secret in secrets.items() if secret in text]
    assert not found, f"in the logs: {found}"
    assert time.monotonic() - started < 60
