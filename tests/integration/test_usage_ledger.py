"""The usage ledger on a real redis-server (issue 44): each finished request counted
once, in the same Lua call as its terminal output entry (``scripts.WRITE_OUTPUTS``),
guarded by its request id; never for an entry the fence kept out; never twice, however
often or concurrently the end is written; and by the streamer in process, through a
write whose reply is lost and through a takeover before and after the end was written."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from tokenizers import Tokenizer

from app.messages import EngineFinish, OutputEvent, OutputKind, TokenDelta
from app.model_card import load_model_card, load_tokenizer
from app.settings import Settings
from app.usage import UsageCount, day_of, hour_of
from broker.celery_app import create_celery
from broker.handoff import GROUP, RequestHandoff
from broker.keys import Keys
from broker.outputs import OutputEntry, OutputStreams
from broker.publish import PublishItem, encode_deltas, lease_value
from broker.requests import ClaimResult, RequestStore
from broker.usage_ledger import UsageLedger
from tests.pipeline import EOS, TEXT
from tests.stack import make_record
from workers.streamer import Streamer

pytestmark = pytest.mark.integration

OWNER = "f" * 64
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tokenizer(models_dir: Path) -> Tokenizer:
    return load_tokenizer(load_model_card(models_dir / "SmolLM2-135M-Instruct"))


def count(prompt: int = 10, completion: int = 4, *, error: bool = False, **kw: Any) -> UsageCount:
    values: dict[str, Any] = {
        "owner": OWNER,
        "model": "m",
        "api": CHAT,
        "prompt_tokens": prompt,
        "cached_tokens": 3,
        "completion_tokens": completion,
        "error": error,
        "at": time.time(),
    }
    values.update(kw)
    return UsageCount(**values)


def terminal(rid: str, usage: UsageCount | None, handoff_id: str = "") -> OutputEntry:
    ev = OutputEvent(OutputKind.USAGE, usage={"prompt_tokens": 10, "completion_tokens": 4})
    return OutputEntry(rid, [ev], "5", first=True, handoff_id=handoff_id, usage=usage)


def totals(client: redis.Redis, keys: Keys) -> dict[str, int]:
    """The all-time counts of OWNER's chats of model m."""
    got = UsageLedger(client, keys).totals()
    return got.get((OWNER, "m", CHAT), {})


def fresh_keys() -> Keys:
    return Keys(f"usage{uuid.uuid4().hex[:6]}:")


def test_a_request_is_counted_once_with_its_end(redis_client: redis.Redis) -> None:
    keys = fresh_keys()
    outputs = OutputStreams(redis_client, keys, ttl_s=60, ledger_days=3)
    c = count(error=True)
    outputs.write([terminal("r1", c)])
    outputs.write([terminal("r1", c)])  # a retry, a second end: the guard holds
    outputs.write([terminal("r2", count(prompt=1, completion=0))])
    outputs.write([OutputEntry("r3", [OutputEvent(OutputKind.DELTA, 0, "x")], "1", first=True)])
    assert totals(redis_client, keys) == {
        "requests": 2,
        "prompt_tokens": 11,
        "cached_tokens": 6,
        "completion_tokens": 4,
        "errors": 1,
    }
    day, hour = keys.usage_day(day_of(c.at)), keys.usage_hour(hour_of(c.at))
    assert redis_client.hget(day, c.label + "p") == b"11"
    assert redis_client.hget(hour, c.label + "n") == b"2"
    assert 2 * 86400 < redis_client.ttl(day) <= 3 * 86400
    assert 2 * 86400 < redis_client.ttl(hour) <= 3 * 86400
    assert redis_client.ttl(keys.usage_total) == -1  # all time
    assert 60 < redis_client.ttl(keys.usage_done("r1")) <= 120  # 2 x the stream TTL
    assert not redis_client.exists(keys.usage_done("r3"))


def test_concurrent_ends_of_one_request_count_once(redis_server: Any) -> None:
    """Sixteen writers end the same request at once, each on its own connection, while
    sixteen others end a request each: 17 requests counted."""
    keys = fresh_keys()
    start = threading.Barrier(32)
    errors: list[BaseException] = []

    def end(rid: str) -> None:
        client = redis.Redis.from_url(redis_server.url)
        try:
            outputs = OutputStreams(client, keys, ttl_s=60)
            start.wait(5)
            outputs.write([terminal(rid, count())])
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    rids = ["same"] * 16 + [f"own-{i}" for i in range(16)]
    threads = [threading.Thread(target=end, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    client = redis.Redis.from_url(redis_server.url)
    try:
        got = totals(client, keys)
    finally:
        client.close()
    assert got["requests"] == 17 and got["completion_tokens"] == 17 * 4


def test_a_fenced_end_is_not_counted_and_its_owner_counts_it(redis_client: redis.Redis) -> None:
    """An end the fence keeps out (another streamer took the request over) is not
    counted; the new owner's is. Counts ride with their own entries among others, plain
    (step lines only) and written out, in one call."""
    keys = fresh_keys()
    handoff = RequestHandoff(redis_client, keys)
    handoff.ensure_group()
    for rid in ("a", "b"):
        redis_client.xadd(keys.new_requests, {"r": rid})
    (a_id, _), (b_id, _) = handoff.claim_new("s1")
    outputs = OutputStreams(redis_client, keys, ttl_s=60)
    # s1 has written a first chunk of each (first: the streams exist, with their TTLs).
    firsts = [
        OutputEntry(rid, [OutputEvent(OutputKind.DELTA, 0, "x")], "1", True, None, hid, 1, True)
        for rid, hid in (("a", a_id), ("b", b_id))
    ]
    assert outputs.write(firsts, owner="s1") == set()
    redis_client.xclaim(keys.new_requests, GROUP, "s2", 0, [a_id], justid=True)
    redis_client.set(keys.handoff_epoch, "after-the-takeover")
    outputs.fence_epoch = "before"
    plain = OutputEntry("b", [OutputEvent(OutputKind.DELTA, 0, "y")], "2", handoff_id=b_id, n=2)
    ends = [
        plain,
        OutputEntry("a", [], "3", handoff_id=a_id, n=2, checkpoint=True, usage=count(5, 1)),
        OutputEntry("b", [], "3", handoff_id=b_id, n=3, checkpoint=True, usage=count(7, 2)),
    ]
    assert outputs.write(ends, owner="s1") == {"a"}
    assert totals(redis_client, keys)["prompt_tokens"] == 7, "only b's end was written"
    again = [OutputEntry("a", [], "3", handoff_id=a_id, n=2, checkpoint=True, usage=count(5, 1))]
    assert outputs.write(again, owner="s2") == set()
    assert totals(redis_client, keys) == {
        "requests": 2,
        "prompt_tokens": 12,
        "cached_tokens": 6,
        "completion_tokens": 3,
        "errors": 0,
    }


def test_a_redis_at_maxmemory_refuses_the_whole_write_then_counts_it_once(
    redis_client: redis.Redis,
) -> None:
    """The count comes after the call's first write: a Redis at maxmemory refuses the
    call before anything is written (the streamer retries it, as before the ledger),
    and once there is room the retry writes the end and counts it once."""
    keys = fresh_keys()
    outputs = OutputStreams(redis_client, keys, ttl_s=60)
    before = redis_client.config_get("maxmemory")["maxmemory"]
    used = int(redis_client.info("memory")["used_memory"])
    redis_client.config_set("maxmemory", used // 2)
    try:
        with pytest.raises(redis.ResponseError, match="OOM"):
            outputs.write([terminal("r1", count())])
    finally:
        redis_client.config_set("maxmemory", before)
    assert not redis_client.exists(keys.output("r1"), keys.usage_done("r1"), keys.usage_total)
    outputs.write([terminal("r1", count())])
    assert totals(redis_client, keys)["requests"] == 1


# -- the streamer, in process --------------------------------------------------------------


def published(settings: Settings, client: redis.Redis, tokenizer: Tokenizer) -> tuple[str, int]:
    """A request of OWNER for TEXT, claimed by worker "w", every token published (then
    EOS): its id and its prompt's length."""
    store = RequestStore(client, Keys(settings.key_prefix), stream_ttl_s=600)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    record = make_record(settings, [ids], max_tokens=200).model_copy(update={"owner": OWNER})
    rid = record.request_id
    store.create(record)
    assert store.claim(rid, 0, "w", 30.0, 0.0) is ClaimResult.OK
    lease = lease_value("w", 0)
    steps = [
        ([TokenDelta(0, ids[:10])], True, False),
        ([TokenDelta(0, ids[10:])], False, False),
        ([TokenDelta(0, [EOS], finish=EngineFinish.EOS)], False, True),
    ]
    for deltas, first, done in steps:
        store.publish([PublishItem(rid, lease, 0, encode_deltas(deltas), first, done)], 30.0)
    return rid, len(ids)


def client_usage(client: redis.Redis, keys: Keys, rid: str) -> dict[str, Any]:
    events = [ev for _n, ev in OutputStreams(client, keys).follow(rid, timeout_s=5)]
    usage = events[-1].usage
    assert events[-1].kind is OutputKind.USAGE and usage is not None
    return usage


def ledger_of(client: redis.Redis, settings: Settings) -> dict[str, int]:
    got = UsageLedger(client, Keys(settings.key_prefix)).totals()
    assert set(got) <= {(OWNER, settings.served_name, CHAT)}, got
    return got.get((OWNER, settings.served_name, CHAT), {})


def run_until_ended(streamer: Streamer, rid: str) -> None:
    for _ in range(20):
        try:
            streamer.iterate()
        except redis.ConnectionError:
            continue  # as the run loop does
        if rid not in streamer.tracked and not streamer._commits:
            return
    raise AssertionError("the request did not end")


@pytest.mark.parametrize("lost", [False, True], ids=["written", "reply-lost-after-it-ran"])
def test_the_streamer_counts_what_its_client_reads(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer, lost: bool
) -> None:
    rid, prompt = published(settings, redis_client, tokenizer)
    streamer = Streamer(settings, redis_client, tokenizer, create_celery(settings))
    streamer.handoff.ensure_group()
    if lost:  # its first write runs, and its reply never comes: it is checked, not redone
        write = streamer.outputs.write

        def ran_then_lost(entries: Any, owner: Any = None, stamp: str = "") -> set[str]:
            if not entries:
                return set()
            streamer.outputs.write = write  # type: ignore[method-assign]
            write(entries, owner, stamp)
            raise redis.ConnectionError("Connection reset by peer")

        streamer.outputs.write = ran_then_lost  # type: ignore[method-assign]
    run_until_ended(streamer, rid)
    usage = client_usage(redis_client, Keys(settings.key_prefix), rid)
    assert usage["prompt_tokens"] == prompt and usage["completion_tokens"] > 10
    assert ledger_of(redis_client, settings) == {
        "requests": 1,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": 0,
        "completion_tokens": usage["completion_tokens"],
        "errors": 0,
    }


@pytest.mark.parametrize("died", ["before-its-end", "after-its-end"])
def test_a_takeover_neither_loses_nor_repeats_the_count(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer, died: str
) -> None:
    """Streamer A decodes the whole request and dies: before the write of its end (B
    takes it over, replays, writes the end and counts it), or after it but before its
    acknowledgement (B finds the end written and only acknowledges)."""
    settings = settings.model_copy(update={"streamer_takeover_s": 0.05})
    rid, _prompt = published(settings, redis_client, tokenizer)
    a = Streamer(settings, redis_client, tokenizer, create_celery(settings), clock=lambda: 1.0)
    a._set_up_loop()
    if died == "before-its-end":
        for _ in range(5):
            a.iterate()  # decoded, its write left for a next cycle that never comes
            if any(c.ended for c in a._commits):
                break
        assert any(c.ended and not c.written for c in a._commits)
    else:
        a.handoff.queue_ack = lambda *_args: None  # type: ignore[method-assign]
        run_until_ended(a, rid)
    assert redis_client.xpending(Keys(settings.key_prefix).new_requests, GROUP)["pending"] == 1
    time.sleep(0.1)  # A's hand-off entry is idle past the takeover time
    b = Streamer(settings, redis_client, tokenizer, create_celery(settings))
    b._set_up_loop()  # its first heartbeat takes A's requests over
    run_until_ended(b, rid)
    assert redis_client.xpending(Keys(settings.key_prefix).new_requests, GROUP)["pending"] == 0
    usage = client_usage(redis_client, Keys(settings.key_prefix), rid)
    got = ledger_of(redis_client, settings)
    assert got["requests"] == 1
    assert got["completion_tokens"] == usage["completion_tokens"]
    assert got["prompt_tokens"] == usage["prompt_tokens"]
