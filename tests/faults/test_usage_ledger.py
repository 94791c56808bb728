"""The usage ledger's acceptance (issue 44): exactly once, whatever dies.

Real processes: redis-server, two Celery workers (echo engine at a finite rate, so every
reply streams for seconds), two streamers and two web servers (A and B), with three API
keys, the third also an admin key. Forty streamed chats (``include_usage``) spread over
the keys and both web servers; once every stream is under way, the worker and the
streamer holding most of them and web A are each SIGKILLed. Clients of A resume on B
(``GET /v1/streams/<id>`` with ``Last-Event-ID``); every client keeps the usage chunk it
finally received. Then the ledger's totals per key, read through ``GET /admin/usage`` on
B, equal exactly what the clients of that key received: requests, prompt and completion
tokens, and no errors (a lost count, or one counted twice by a takeover, a resume or a
retried write, would show here).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from app.usage import day_of
from broker.connection import redis_client
from broker.keys import Keys
from broker.requests import RequestStore
from tests.faults.web_clients import words
from tests.stack import (
    Proc,
    Stack,
    busiest,
    full_stack,
    isolated_settings,
    wait_for,
    web_process,
    web_settings,
)
from web.auth import key_owner

pytestmark = pytest.mark.faults
logger = logging.getLogger(__name__)

STREAMS = 40
RATE = 12.0  # echo tokens per second: a reply of ``prompt(i)`` streams for ~5 s
KEYS = ("sk-usage-a", "sk-usage-b", "sk-usage-admin")
LEASE_TTL_S = 2.0
TAKEOVER_S = 2.0
WAIT_S = 60.0


def prompt(i: int) -> str:
    return words(f"usage {i}", 24 + i % 5)


@dataclass
class Client:
    """One streamed chat of one key, as its client reads it: text, the usage chunk it
    finally got, and whether it ended with ``[DONE]``; resumed with ``Last-Event-ID``."""

    key: str
    content: str
    request_id: str | None = None
    last_id: str | None = None
    text: str = ""
    usage: dict[str, Any] | None = None
    usages: int = 0
    done: bool = False
    connections: int = 0
    errors: list[Any] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def run(self, base: str, resume_on: str) -> None:
        resp = requests.post(
            f"{base}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": self.content}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers=self.headers,
            stream=True,
            timeout=(5, WAIT_S),
        )
        self.request_id = resp.headers.get("x-request-id")
        self._read(resp)
        while not self.done and not self.errors and self.connections < 5:
            extra = {"Last-Event-ID": self.last_id} if self.last_id else {}
            resp = requests.get(
                f"{resume_on}/v1/streams/{self.request_id}",
                headers={**self.headers, **extra},
                stream=True,
                timeout=(5, WAIT_S),
            )
            self._read(resp)

    def _read(self, resp: requests.Response) -> None:
        self.connections += 1
        if resp.status_code != 200:
            self.errors.append((resp.status_code, resp.text))
            return
        lines: list[str] = []
        try:
            for line in resp.iter_lines():
                if line:
                    lines.append(line.decode())
                    continue
                # A complete event (a half-received one is dropped, as EventSource does).
                event_id = next((ln[3:].strip() for ln in lines if ln.startswith("id:")), None)
                data = next((ln[5:].strip() for ln in lines if ln.startswith("data:")), None)
                lines = []
                if data == "[DONE]":
                    self.done = True
                    return
                if data is not None:
                    self._event(json.loads(data), event_id)
        except requests.RequestException as exc:  # its web process died under it
            logger.info("SSE connection of %s ended: %r", self.request_id, exc)
        finally:
            resp.close()

    def _event(self, payload: dict[str, Any], event_id: str | None) -> None:
        if "error" in payload:
            self.errors.append(payload)
            return
        self.text += "".join(c["delta"].get("content") or "" for c in payload["choices"])
        if payload.get("usage"):
            self.usage = payload["usage"]
            self.usages += 1
        if event_id:
            self.last_id = event_id


@pytest.fixture
def stack(models_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=RATE,
        worker_slots=STREAMS,
        lease_ttl_s=LEASE_TTL_S,
        streamer_takeover_s=TAKEOVER_S,
        api_keys=list(KEYS),
        admin_api_keys=[KEYS[2]],
        resume_grace_s=30.0,
        sse_keepalive_s=0.5,
        web_workers=1,
        web_threads=48,
    )
    with full_stack(
        settings,
        tmp_path / "logs",
        workers=("w1", "w2"),
        streamers=("s1", "s2"),
        web="web-b",
    ) as running:
        yield running


def sigkill(proc: Proc, what: str) -> None:
    proc.kill_group()
    logger.warning("SIGKILLed %s (pid %d)", what, proc.pid)


def ledger(base: str, owner: str) -> dict[str, int]:
    """The key's totals through ``GET /admin/usage`` (today and yesterday, UTC: a run
    across midnight counts in both)."""
    now = time.time()
    resp = requests.get(
        f"{base}/admin/usage",
        params={"key": owner, "from": day_of(now - 86400), "to": day_of(now)},
        headers={"Authorization": f"Bearer {KEYS[2]}"},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert {row["key"] for row in body["data"]} <= {owner[:16]}
    totals: dict[str, int] = body["totals"]
    return totals


@pytest.mark.timeout(240)
def test_the_ledger_counts_each_request_exactly_once_through_sigkills(stack: Stack) -> None:
    b_url = stack.base_url
    a_settings = web_settings(stack.settings)
    a_url = f"http://{a_settings.host}:{a_settings.port}"
    web_a = stack.start("web-a", web_process(a_settings, stack.log_dir, name="web-a"))
    clients = [Client(KEYS[i % 3], prompt(i)) for i in range(STREAMS)]
    threads = [
        threading.Thread(target=c.run, args=(a_url if i % 2 == 0 else b_url, b_url), daemon=True)
        for i, c in enumerate(clients)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    wait_for(lambda: all(len(c.text) >= 12 for c in clients), WAIT_S, "every stream under way")
    sigkill(busiest(stack, "worker", STREAMS // 2), "the busiest worker")
    time.sleep(0.3)
    streamer = busiest(stack, "streamer", STREAMS // 2)
    sigkill(streamer, "the busiest streamer")
    time.sleep(0.3)
    sigkill(web_a, "web A")
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a client is still reading"
    logger.warning("40 streams done %.1f s after they started", time.monotonic() - started)

    for c in clients:
        assert not c.errors and c.done, (c.request_id, c.errors, stack.logs()[-3000:])
        assert c.text == c.content, c.request_id
        assert c.usage is not None and c.usages == 1, c.request_id
    # Each kill hit streams: clients resumed, requests were resumed on the other worker,
    # and the other streamer took requests over.
    assert any(c.connections > 1 for c in clients), "no client had to resume"
    client = redis_client(stack.settings.redis_url, max_connections=2)
    try:
        store = RequestStore(client, Keys(stack.settings.key_prefix))
        states = [store.state(str(c.request_id)) for c in clients]
    finally:
        client.connection_pool.disconnect()
    assert any(s is not None and s[1] > 0 for s in states), "no request lost its worker"
    survivor = next(p for n, p in stack.procs.items() if n in ("s1", "s2") and p is not streamer)
    assert "took over request" in survivor.log.read_text(errors="replace")

    for key in KEYS:
        mine = [c for c in clients if c.key == key]
        got = ledger(b_url, key_owner(key))
        expected = {
            "requests": len(mine),
            "prompt_tokens": sum(int(c.usage["prompt_tokens"]) for c in mine if c.usage),
            "completion_tokens": sum(int(c.usage["completion_tokens"]) for c in mine if c.usage),
            "errors": 0,
        }
        assert {k: got[k] for k in expected} == expected, key
    logger.warning(
        "ledger == what the clients received, per key; %d clients resumed",
        sum(1 for c in clients if c.connections > 1),
    )
