"""The streamer in-process, against a real redis-server, when Redis fails the round trip
that writes a cycle's output: the decoders have already moved on, so the entries must
be written once Redis answers again, exactly once, whether the failed round trip was
lost before Redis ran it or after (Redis ran it, then died before answering)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from tokenizers import Tokenizer

from app.messages import EngineFinish, TokenDelta
from app.model_card import load_model_card, load_tokenizer
from app.settings import Settings
from broker.celery_app import create_celery
from broker.handoff import RequestHandoff
from broker.keys import Keys
from broker.outputs import OutputEntry, OutputStreams
from broker.publish import PublishItem, encode_deltas, lease_value
from broker.requests import ClaimResult, RequestStore
from tests.pipeline import EOS, TEXT, collect
from tests.stack import make_record
from workers.streamer import Streamer

pytestmark = pytest.mark.integration


class FlakyOutputs(OutputStreams):
    """Real output streams whose first non-empty write fails like a dying Redis: before
    running it (``ran=False``) or after (``ran=True``). Either way of writing can fail:
    alone, or carried by the streamer's next read (``write_then_read``)."""

    def __init__(self, inner: OutputStreams, *, ran: bool) -> None:
        super().__init__(inner.redis, inner.keys, ttl_s=inner.ttl_s)
        self.ran = ran
        self.failures = 0
        self.failed_in = ""  # which way of writing failed

    def _fail_once(
        self, entries: Sequence[OutputEntry], owner: str | None, way: str, stamp: str
    ) -> None:
        if entries and self.failures == 0:
            self.failures += 1
            self.failed_in = way
            if self.ran:
                super().write(entries, owner, stamp)
            raise redis.ConnectionError("Connection reset by peer")

    def write(
        self, entries: Sequence[OutputEntry], owner: str | None = None, stamp: str = ""
    ) -> set[str]:
        self._fail_once(entries, owner, "alone", stamp)
        return super().write(entries, owner, stamp)

    def write_then_read(
        self, entries: Sequence[OutputEntry], owner: str, *args: Any, **kwargs: Any
    ) -> Any:
        self._fail_once(entries, owner, "carried", kwargs.get("stamp", ""))
        return super().write_then_read(entries, owner, *args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(models_dir: Path) -> Tokenizer:
    return load_tokenizer(load_model_card(models_dir / "SmolLM2-135M-Instruct"))


def published_request(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer, *, whole: bool
) -> str:
    """A request for TEXT, claimed by worker "w", with its first 10 tokens published
    (``whole``: all of them, then EOS); its id."""
    store = RequestStore(redis_client, Keys(settings.key_prefix), stream_ttl_s=600)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    record = make_record(settings, [ids], max_tokens=200)
    rid = record.request_id
    store.create(record)
    assert store.claim(rid, 0, "w", 30.0, 0.0) is ClaimResult.OK
    lease = lease_value("w", 0)
    steps = [([TokenDelta(0, ids[:10])], True, False)]
    if whole:
        steps.append(([TokenDelta(0, ids[10:])], False, False))
        steps.append(([TokenDelta(0, [EOS], finish=EngineFinish.EOS)], False, True))
    for deltas, first, done in steps:
        store.publish([PublishItem(rid, lease, 0, encode_deltas(deltas), first, done)], 30.0)
    return rid


@pytest.mark.parametrize("way", ["alone", "carried"])
@pytest.mark.parametrize("ran", [False, True], ids=["lost-before-running", "lost-after"])
def test_output_of_a_failed_write_is_written_once(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer, ran: bool, way: str
) -> None:
    keys = Keys(settings.key_prefix)
    rid = published_request(settings, redis_client, tokenizer, whole=True)

    if way == "alone":
        # The first cycle's watchdog flushes the output on its own before it runs.
        streamer = Streamer(settings, redis_client, tokenizer, create_celery(settings))
        streamer.handoff.ensure_group()
    else:
        # A clock that stands still never makes the watchdog due, and after the set-up
        # the wake-up read does not see the hand-off entry again: the output written by
        # the next cycle's read round trip, as while requests stream.
        streamer = Streamer(
            settings, redis_client, tokenizer, create_celery(settings), clock=lambda: 1.0
        )
        streamer._set_up_loop()
    flaky = FlakyOutputs(streamer.outputs, ran=ran)
    streamer.outputs = flaky
    for _ in range(10):
        try:
            streamer.iterate()
        except redis.ConnectionError:
            continue  # as the run loop does: pause, then go on
        if rid not in streamer.tracked:
            break
    assert flaky.failures == 1 and flaky.failed_in == way and rid not in streamer.tracked
    events = [ev for _eid, ev in OutputStreams(redis_client, keys).follow(rid, timeout_s=5)]
    got = collect(iter(events))
    assert got.texts == {0: TEXT}
    assert got.usage is not None and not got.errors
    entries = redis_client.xrange(keys.output(rid))
    assert len(entries) == 1, "the cycle's entry was written once"
    steps = redis_client.xrange(keys.output_steps(streamer.consumer))
    assert len(steps) == 1, "its step entry was written once"


def test_the_read_blocks_until_the_watchdog_is_due(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer
) -> None:
    """No fixed short block: an idle streamer wakes when its watchdog is due (twice a
    second), and never asks Redis to block for ever (BLOCK 0)."""
    now = [100.0]
    streamer = Streamer(
        settings, redis_client, tokenizer, create_celery(settings), clock=lambda: now[0]
    )
    streamer._set_up_loop()  # the watchdog ran at 100.0
    assert streamer._block_ms() == 500
    now[0] = 100.3
    assert 199 <= streamer._block_ms() <= 200
    now[0] = 101.0  # overdue
    assert streamer._block_ms() == 1
    started = time.monotonic()
    now[0] = 100.0
    streamer._last_watchdog = 99.6  # due in 0.1 s: the idle cycle returns about then
    streamer.iterate()
    assert 0.05 < time.monotonic() - started < 0.45


@pytest.mark.parametrize("noticed", [False, True], ids=["write-first", "heartbeat-first"])
def test_a_cycle_decoded_before_a_takeover_is_not_written(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer, noticed: bool
) -> None:
    """A streamer decodes a cycle, stalls before its write (SIGSTOP, a pause), and
    another streamer takes the request over meanwhile: the write that goes out when it
    wakes must not land. The streamer writes without checking each entry's owner while
    the hand-off epoch is the one it last checked under. Either the write goes first:
    the takeover changed the epoch, so it checks, and is fenced; or a heartbeat first
    finds the request taken under the new epoch: the decoded cycle is dropped with it,
    since its write would no longer be checked."""
    keys = Keys(settings.key_prefix)
    rid = published_request(settings, redis_client, tokenizer, whole=False)
    # A clock that stands still: no watchdog, no stall check after the set-up.
    streamer = Streamer(
        settings, redis_client, tokenizer, create_celery(settings), clock=lambda: 1.0
    )
    streamer._set_up_loop()
    for _ in range(5):
        streamer.iterate()
        if any(c.outputs and not c.written for c in streamer._commits):
            break
    assert rid in streamer.tracked, "adopted and decoded: its first output waits to be written"
    streamer._drop_taken_over()  # what each heartbeat does: learn the epoch
    assert streamer.outputs.fence_epoch is not None

    taken = RequestHandoff(redis_client, keys).take_over("s-other", min_idle_ms=0)
    assert [r for _eid, r in taken] == [rid]
    if noticed:
        streamer._drop_taken_over()
    streamer.iterate()  # the stale write goes out with the next read

    assert redis_client.xlen(keys.output(rid)) == 0, "the stalled streamer's write landed"
    assert rid not in streamer.tracked
