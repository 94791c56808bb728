"""Redis Sentinel failover under real processes.

A master, one replica and three sentinels (``tests.sentinels.SentinelGroup``), every
tokenrelay process (worker, streamer, web, batch driver) and Flower given the
``redis+sentinel://`` URL. The master is SIGKILLed while
streams run; the sentinels promote the replica within seconds. Every stream must then
finish with exactly its text or end with a clear error event (never hang), new requests
must succeed within 30 s of the kill, and no tokenrelay process may die or be replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.connection import redis_client
from broker.keys import Keys
from broker.registry import batcher_registry
from broker.server import free_port
from tests.faults.web_clients import (
    CHAT,
    Failover,
    Stream,
    chat_once,
    children,
    flower_workers,
    words,
)
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
        Failover.start(base, model, streams, report)

        old_master = group.master_port()
        assert old_master is not None
        seen = Failover(group.kill_master(), streams)
        seen.watch(lambda: group.wait_failover(old_master, 30))
        # New requests from the moment of the kill: what they get while there is no
        # master, and when the first one succeeds with its exact text.
        seen.probe(base, model, NEW_REQUEST_WITHIN_S)
        summary = seen.finish(STREAMS_END_WITHIN_S)
        assert seen.promoted, f"the sentinels did not fail over\n{group.logs()}"
        logger.warning("sentinel failover: %s", seen.line(summary))
        # While there is no master, a new request is refused at once (never a 500, a hang).
        seen.check(summary, procs, report())

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
