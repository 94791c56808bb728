"""Redis Sentinel failover under real processes.

A master, one replica and three sentinels (``tests.sentinels.SentinelGroup``), every
tokenrelay process (worker, streamer, web, batch driver) and Flower given the
``redis+sentinel://`` URL. The master is SIGKILLed while
streams run; the sentinels promote the replica within seconds. Every stream must then
finish with exactly its text or end with a clear error event (never hang), new requests
must succeed within 30 s of the kill, and no tokenrelay process may die or be replaced.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from broker.connection import redis_client
from broker.keys import Keys
from broker.registry import batcher_registry
from broker.server import free_port
from tests.faults.web_clients import CHAT, Stream, children, read_stream, words
from tests.sentinels import SentinelGroup
from tests.stack import flower_process, full_stack, isolated_settings, wait_for

pytestmark = pytest.mark.faults
logger = logging.getLogger(__name__)

RATE = 20.0  # echo tokens per second per request: a stream lasts several seconds
STREAMS = 6
NEW_REQUEST_WITHIN_S = 30.0
STREAMS_END_WITHIN_S = 60.0


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    with SentinelGroup(tmp_path / "redis") as running:
        yield running


# -- our own client ----------------------------------------------------------------------


def test_client_follows_the_failover(group: SentinelGroup) -> None:
    """One client from ``redis_client``: before the kill it writes to the master; after it,
    once the sentinels have promoted the replica, the same client writes there, and what
    was replicated before the kill is still there. A dead sentinel listed first costs
    no time (no retries with backoff on it before the next is asked)."""
    dead = f"127.0.0.1:{free_port()}"
    client = redis_client(group.url.replace("://", f"://{dead},"), max_connections=4)
    started = time.monotonic()
    client.set("before", "1")
    assert time.monotonic() - started < 1.0
    old = group.master_port()
    assert old == group.master.port  # type: ignore[union-attr]

    def replicated() -> bool:
        with group.replicas[0].client() as replica:  # closed: a leaked socket fails a test
            return bool(replica.get("before") == b"1")

    wait_for(replicated, 10, "replication")

    killed = group.kill_master()
    errors = 0

    def writes() -> bool:
        nonlocal errors
        try:
            client.set("after", "2")
            return True
        except redis.ConnectionError:
            errors += 1
            return False

    wait_for(writes, 30, "a write to succeed after the failover", interval=0.2)
    recovered = time.monotonic() - killed
    new = group.master_port()
    assert new == group.replicas[0].port, group.logs()
    assert client.get("before") == b"1"
    address = client.connection_pool.master_address  # type: ignore[attr-defined]
    assert address == ("127.0.0.1", new)
    # Failed reconnects do not pile up in the pool.
    assert len(client.connection_pool._connections) <= 4  # type: ignore[attr-defined]
    logger.info("client wrote again %.1f s after the kill (%d failed tries)", recovered, errors)
    client.close()


# -- the whole stack ------------------------------------------------------------------------


def chat_status(
    base_url: str, model: str, content: str, timeout: float = 10
) -> tuple[str, str | None]:
    """A non-streaming request: its HTTP status (or the exception's name), and its text
    when it succeeded."""
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    try:
        resp = requests.post(base_url + CHAT, json=body, timeout=timeout)
    except requests.RequestException as exc:
        return type(exc).__name__, None
    if resp.status_code != 200:
        retry_after = resp.headers.get("Retry-After")
        hint = f" (Retry-After {retry_after})" if retry_after else ""
        return f"{resp.status_code}{hint}", None
    text: str = resp.json()["choices"][0]["message"]["content"]
    return "200", text


def chat_once(base_url: str, model: str, content: str, timeout: float = 10) -> str | None:
    """A non-streaming request; its text, or None when it did not succeed."""
    return chat_status(base_url, model, content, timeout)[1]


def flower_workers(port: int, auth: str) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/workers?refresh=1",
        headers={"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            workers: dict[str, Any] = json.loads(resp.read())
            return workers
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return {}


def test_failover_mid_stream(group: SentinelGroup, models_dir: Path, tmp_path: Path) -> None:
    settings = isolated_settings(
        group.url,
        models_dir,
        echo_tokens_per_second=RATE,
        web_workers=1,
        web_threads=16,
        sse_keepalive_s=1.0,
    )
    flower_port, flower_auth = free_port(), "ops:secret"
    with full_stack(settings, tmp_path / "logs", start_redis=False, batcher=True) as stack:
        settings, procs = stack.settings, stack.procs
        model, base = settings.served_name, stack.base_url
        keys = Keys(settings.key_prefix)
        stack.start("flower", flower_process(settings, stack.log_dir, flower_port, flower_auth))

        def report() -> str:
            return stack.logs() + "\n" + group.logs()

        node = f"tokenrelay-{procs['worker'].pid}@"

        def listed(workers: dict[str, Any]) -> bool:
            return any(name.startswith(node) for name in workers)

        warm = "warm up over Sentinel"
        assert chat_once(base, model, warm, timeout=30) == warm, report()
        wait_for(
            lambda: listed(flower_workers(flower_port, flower_auth)),
            30,
            "Flower to list the worker over Sentinel",
            interval=0.5,
        )
        pids = {name: p.pid for name, p in procs.items()}
        web_children = children(procs["web"].pid)
        assert web_children, "gunicorn has no worker process"

        streams = [Stream(CHAT, words(f"stream {i}")) for i in range(STREAMS)]
        threads = [
            threading.Thread(target=read_stream, args=(base, model, s), daemon=True)
            for s in streams
        ]
        for t in threads:
            t.start()
        for s in streams:
            assert s.started.wait(30), f"a stream got no text before the kill\n{report()}"
        assert all(not s.ended.is_set() for s in streams), "streams too short to be mid-stream"

        old_master = group.master_port()
        assert old_master is not None
        killed = group.kill_master()
        promoted: list[float] = []

        def watch() -> None:
            group.wait_failover(old_master, 30)
            promoted.append(time.monotonic() - killed)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        # New requests from the moment of the kill: what they get while there is no
        # master, and when the first one succeeds with its exact text.
        probe = "new request after the failover"
        first_ok: float | None = None
        attempts: list[str] = []
        while time.monotonic() - killed < NEW_REQUEST_WITHIN_S:
            sent = time.monotonic()
            status, text = chat_status(base, model, probe)
            attempts.append(f"{sent - killed:.1f}s: {status} in {time.monotonic() - sent:.1f}s")
            if text == probe:
                first_ok = time.monotonic() - killed
                break
            time.sleep(0.5)
        watcher.join(30)
        assert promoted, f"the sentinels did not fail over\n{group.logs()}"
        failover_s = promoted[0]

        end_by = killed + STREAMS_END_WITHIN_S
        for s in streams:
            s.ended.wait(max(0.0, end_by - time.monotonic()))
        outcomes = [s.outcome() for s in streams]
        summary = {k: outcomes.count(k) for k in ("exact", "error", "hung", "wrong", "broken")}
        last_end = max((s.ended_at or end_by) - killed for s in streams)
        logger.warning(
            "sentinel failover: promoted %.1f s after the kill; first new request ok at %s s; "
            "streams %s, the last ended %.1f s after the kill; new requests: %s",
            failover_s,
            f"{first_ok:.1f}" if first_ok is not None else "never",
            summary,
            last_end,
            "; ".join(attempts),
        )
        details = "\n".join(
            f"{o}: finish={s.finish} error={s.error} failure={s.failure} "
            f"got={len(s.text)}/{len(s.content)} chars"
            for o, s in zip(outcomes, streams, strict=True)
        )
        dead = [n for n, p in procs.items() if not p.alive()]
        assert not dead, f"{dead} died\n{details}\n{report()}"
        assert first_ok is not None, f"no new request succeeded within 30 s\n{details}\n{report()}"
        # While there is no master, a new request is refused at once (never a 500, a hang).
        refused_badly = [a for a in attempts if not (": 503 " in a or ": 200 " in a)]
        assert not refused_badly, f"{attempts}\n{report()}"
        assert summary["hung"] == 0, f"{details}\n{report()}"
        assert summary["wrong"] == summary["broken"] == 0, f"{details}\n{report()}"

        # Nothing was restarted: same PIDs, same gunicorn workers; the worker still
        # registered, Flower still sees it through the new master.
        assert {n: p.pid for n, p in procs.items()} == pids
        assert children(procs["web"].pid) == web_children
        wait_for(
            lambda: listed(flower_workers(flower_port, flower_auth)),
            30,
            "Flower to list the worker after the failover",
            interval=0.5,
        )
        # The batch driver heartbeats on the new master (it holds no request here).
        registry = batcher_registry(redis_client(group.url, max_connections=2), keys)
        wait_for(
            lambda: any(m.pid == procs["batcher"].pid for m in registry.live()),
            30,
            "the batch driver to heartbeat on the new master",
            interval=0.5,
        )
        again = "and one more, exactly"
        assert chat_once(base, model, again, timeout=30) == again, report()
