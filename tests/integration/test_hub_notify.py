"""Readers that wait for many streams on one event (``OutputHub.subscribe(notify=...)``,
as ``benchmarks/relay.py``'s client does) are woken once per hub read, however many of
their streams the read brought (real redis-server)."""

from __future__ import annotations

import threading

import pytest
import redis

from app.messages import OutputEvent, OutputKind
from app.settings import Settings
from broker.hub import OutputHub
from broker.keys import Keys
from broker.outputs import OutputEntry, OutputStreams

pytestmark = pytest.mark.integration


class CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_one_wake_per_read_for_streams_that_share_an_event(
    redis_client: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.key_prefix)
    outputs = OutputStreams(redis_client, keys)
    rids = ["notify-a", "notify-b", "notify-c"]
    for rid in rids:
        outputs.write([OutputEntry(rid, [OutputEvent(OutputKind.DELTA, 0, rid)], "1", first=True)])
    hub = OutputHub(redis_client, keys, block_ms=100)
    hub.stopping.set()  # its reader thread ends at once: the reads are made here
    shared, own = CountingEvent(), CountingEvent()
    subs = [hub.subscribe(rid, notify=shared, wake=False) for rid in rids]
    alone = hub.subscribe(rids[0], notify=own, wake=False)  # a second reader of one stream
    hub._read_once()
    assert [sub.take(None)[1][0].text for sub in subs] == rids
    assert alone.take(None)[1][0].text == rids[0]
    assert (shared.sets, own.sets) == (1, 1)
