"""Worker step streams: one entry per publish with every token entry it appended.

A streamer reads a request's first token entries from the request's own token stream;
the entry names the worker (``w``), and from then on the streamer reads that worker's
step stream (one entry per engine step for all its requests) instead. The token streams
stay the record (takeover replay, resume, ``progress``). These tests drive the publish
script and a streamer in-process against a real redis-server, and check the text is
exact when a request moves to another worker, with or without the streamer knowing,
and when a step entry is lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from tokenizers import Tokenizer

from app.messages import EngineFinish, TokenDelta
from app.model_card import load_model_card, load_tokenizer
from app.records import RequestRecord
from app.settings import Settings
from broker.celery_app import create_celery
from broker.keys import Keys
from broker.outputs import OutputStreams
from broker.publish import PublishItem, encode_deltas, lease_value
from broker.requests import ClaimResult, RequestStore
from broker.step_lines import below_ms, split_step, step_columns, step_head, step_line
from tests.pipeline import EOS, TEXT, collect
from tests.stack import make_record
from workers import streamer as streamer_module
from workers.streamer import STEP_QUIET_S, Streamer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tokenizer(models_dir: Path) -> Tokenizer:
    return load_tokenizer(load_model_card(models_dir / "SmolLM2-135M-Instruct"))


@pytest.fixture
def store(settings: Settings, redis_client: redis.Redis) -> RequestStore:
    return RequestStore(redis_client, Keys(settings.key_prefix), stream_ttl_s=600)


def pieces(tokenizer: Tokenizer, parts: int = 6) -> list[list[TokenDelta]]:
    """TEXT's ids as ``parts`` steps of one request (the last ends it with EOS)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    size = -(-len(ids) // parts)
    steps = [[TokenDelta(0, ids[i : i + size])] for i in range(0, len(ids), size)]
    steps.append([TokenDelta(0, [EOS], finish=EngineFinish.EOS)])
    return steps


def publish(
    store: RequestStore, rid: str, worker: str, attempt: int, deltas: list[TokenDelta], **kw: Any
) -> None:
    item = PublishItem(rid, lease_value(worker, attempt), attempt, encode_deltas(deltas), **kw)
    assert store.publish([item], 30.0, worker_id=worker)[0] == 0


class Reads:
    """Records the streams each of the streamer's reads asks for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[set[str]] = []
        real = streamer_module.read_rest

        def spy(via: Any, streams: dict[str, str], reply: Any, **kw: Any) -> Any:
            self.calls.append(set(streams))
            return real(via, streams, reply, **kw)

        monkeypatch.setattr(streamer_module, "read_rest", spy)


def start(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer, now: list[float]
) -> Streamer:
    streamer = Streamer(
        settings, redis_client, tokenizer, create_celery(settings), clock=lambda: now[0]
    )
    streamer._set_up_loop()
    return streamer


def run_until(streamer: Streamer, rid: str) -> None:
    for _ in range(20):
        streamer.iterate()
        if rid not in streamer.tracked:
            return
    raise AssertionError("the request did not end")


def text_of(redis_client: redis.Redis, keys: Keys, rid: str) -> str:
    events = [ev for _eid, ev in OutputStreams(redis_client, keys).follow(rid, timeout_s=5)]
    got = collect(iter(events))
    assert got.usage is not None and not got.errors, got
    return got.texts[0]


def new_request(settings: Settings, store: RequestStore, worker: str) -> RequestRecord:
    record = make_record(settings, [[1, 2, 3]], max_tokens=200)
    store.create(record)
    assert store.claim(record.request_id, 0, worker, 30.0, 0.0) is ClaimResult.OK
    return record


def following_a(
    settings: Settings,
    redis_client: redis.Redis,
    store: RequestStore,
    tokenizer: Tokenizer,
    now: list[float],
    published: int,
) -> tuple[str, Streamer, list[list[TokenDelta]]]:
    """A request worker wA has published ``published`` steps of, and a streamer that
    reads it from wA's step stream by then: (request id, streamer, all the steps)."""
    rid = new_request(settings, store, "wA").request_id
    streamer = start(settings, redis_client, tokenizer, now)
    steps = pieces(tokenizer)
    for deltas in steps[:published]:
        publish(store, rid, "wA", 0, deltas, first=deltas is steps[0])
        streamer.iterate()
    streamer.iterate()
    assert streamer.tracked[rid].step == Keys(settings.key_prefix).steps("wA")
    return rid, streamer, steps


def ends_exact(
    store: RequestStore, streamer: Streamer, rid: str, worker: str, attempt: int, last: Any
) -> None:
    """Publish the request's last step from ``worker``; the streamer must end it with
    exactly the text."""
    publish(store, rid, worker, attempt, last, done=True)
    run_until(streamer, rid)
    assert text_of(streamer.redis, streamer.keys, rid) == TEXT


def test_publish_writes_one_step_entry_per_call(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    keys = Keys(settings.key_prefix)
    a, b = (new_request(settings, store, "wA") for _ in range(2))
    for step in range(2):
        items = [
            PublishItem(r.request_id, lease_value("wA", 0), 0, encode_deltas([d]), step == 0)
            for r, d in ((a, TokenDelta(0, [10 + step])), (b, TokenDelta(0, [20 + step])))
        ]
        assert store.publish(items, 30.0, worker_id="wA") == [0, 0]
    entries = redis_client.xrange(keys.steps("wA"))
    assert len(entries) == 2
    assert redis_client.ttl(keys.steps("wA")) > 0
    for step, (_sid, fields) in enumerate(entries):
        lines = split_step(fields[b"d"])
        assert [line[0] for line in lines] == [keys.tokens(a.request_id), keys.tokens(b.request_id)]
        for tok_key, attempt, n, payload in lines:
            # No ordinal given: every chunk is also a checkpoint of its own.
            tok_fields = redis_client.xrange(tok_key)[step][1]
            assert attempt == "0" and n == step + 1 == int(tok_fields[b"n"])
            assert payload == tok_fields[b"d"] and tok_fields[b"w"] == b"wA"
            assert tok_fields[b"s"] == _sid
    # Without a worker id (an older caller): no step entry; ordinals go on all the same.
    refresh = PublishItem(a.request_id, lease_value("wA", 0), 0, b"")
    store.publish([refresh], 30.0, worker_id="wA")  # a lease refresh: no entry anywhere
    item = PublishItem(a.request_id, lease_value("wA", 0), 0, encode_deltas([TokenDelta(0, [9])]))
    store.publish([item], 30.0)
    assert len(redis_client.xrange(keys.steps("wA"))) == 2
    last = redis_client.xrevrange(keys.tokens(a.request_id), count=1)[0][1]
    assert int(last[b"n"]) == 3 and b"w" not in last


def test_a_request_is_read_from_its_workers_step_stream(
    settings: Settings,
    redis_client: redis.Redis,
    store: RequestStore,
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = Keys(settings.key_prefix)
    reads = Reads(monkeypatch)
    rid, streamer, steps = following_a(settings, redis_client, store, tokenizer, [1.0], 1)
    reads.calls.clear()
    for deltas in steps[1:-1]:
        publish(store, rid, "wA", 0, deltas)
        streamer.iterate()
    ends_exact(store, streamer, rid, "wA", 0, steps[-1])
    # From the first entry on, not one read of the request's own token stream.
    assert reads.calls and all(keys.tokens(rid) not in c for c in reads.calls)
    assert all(keys.steps("wA") in c for c in reads.calls)


def test_a_resumed_request_follows_its_new_worker(
    settings: Settings, redis_client: redis.Redis, store: RequestStore, tokenizer: Tokenizer
) -> None:
    """The streamer resumes it (its lease is gone): it reads its own stream again, where
    the new worker's first entry names the new step stream."""
    keys = Keys(settings.key_prefix)
    now = [1.0]
    rid, streamer, steps = following_a(settings, redis_client, store, tokenizer, now, 3)
    redis_client.delete(keys.lease(rid))  # worker A died
    now[0] += 1.0  # the watchdog is due: it resumes the request as attempt 1
    streamer.iterate()
    assert streamer.tracked[rid].step is None
    assert store.claim(rid, 1, "wB", 30.0, 0.0) is ClaimResult.OK
    for deltas in steps[3:-1]:
        publish(store, rid, "wB", 1, deltas)
        streamer.iterate()
    assert streamer.tracked[rid].step == keys.steps("wB")
    ends_exact(store, streamer, rid, "wB", 1, steps[-1])


def test_a_move_the_streamer_missed_is_found_once_the_step_stream_is_quiet(
    settings: Settings, redis_client: redis.Redis, store: RequestStore, tokenizer: Tokenizer
) -> None:
    """The same attempt claimed by another worker (a message redelivered after a clean
    shutdown released the lease): nothing tells the streamer, whose step stream goes
    quiet; after ``STEP_QUIET_S`` it reads the request's own stream again."""
    keys = Keys(settings.key_prefix)
    now = [1.0]
    rid, streamer, steps = following_a(settings, redis_client, store, tokenizer, now, 2)
    redis_client.delete(keys.lease(rid))
    assert store.claim(rid, 0, "wB", 30.0, 0.0) is ClaimResult.OK
    for deltas in steps[2:-1]:
        publish(store, rid, "wB", 0, deltas)
    streamer.iterate()
    t = streamer.tracked[rid]
    assert t.step == keys.steps("wA") and t.n == 2  # still waiting on worker A's stream
    now[0] += STEP_QUIET_S + 0.6  # past the quiet time, and the watchdog is due
    streamer.iterate()
    streamer.iterate()
    assert t.step == keys.steps("wB") and t.n == len(steps) - 1  # found, and caught up
    ends_exact(store, streamer, rid, "wB", 0, steps[-1])


def test_a_lost_step_entry_is_a_gap_read_from_the_token_stream(
    settings: Settings, redis_client: redis.Redis, store: RequestStore, tokenizer: Tokenizer
) -> None:
    keys = Keys(settings.key_prefix)
    rid, streamer, steps = following_a(settings, redis_client, store, tokenizer, [1.0], 1)
    publish(store, rid, "wA", 0, steps[1])
    # That step entry is gone before the streamer reads it (trimmed, say).
    ((sid, _),) = redis_client.xrevrange(keys.steps("wA"), count=1)
    redis_client.xdel(keys.steps("wA"), sid)
    for deltas in steps[2:-1]:
        publish(store, rid, "wA", 0, deltas)
        streamer.iterate()
    ends_exact(store, streamer, rid, "wA", 0, steps[-1])


def test_below_ms_and_split_step() -> None:
    assert below_ms("1700000000123-7") == "1700000000122-18446744073709551615"
    assert below_ms("0-5") == "0-0"
    raw = b"tr:tok:a\n1-0\n1\n[[0,[5]]]\ntr:tok:b\n1-1\n4\n[]"
    assert split_step(raw) == [
        ("tr:tok:a", "1-0", 1, b"[[0,[5]]]"),
        ("tr:tok:b", "1-1", 4, b"[]"),
    ]
    # The streamer's columns: the same lines, keys not decoded.
    assert step_columns(raw) == ([b"tr:tok:a", b"tr:tok:b"], [1, 4], [b"[[0,[5]]]", b"[]"])
    assert step_columns(raw + b"\ntr:tok:c") == step_columns(raw)  # a partial line: left out
    with pytest.raises(ValueError):
        step_columns(b"tr:tok:a\n1-0\nx\n[]")


def test_step_head_is_step_lines_start() -> None:
    for key, second, n, payload in [("tr:tok:a", 0, 5, b"[]"), ("tr:o:東京", "12", 1, b"x")]:
        assert step_line(key, second, n, payload) == b"%s%d\n%s" % (
            step_head(key, second),
            n,
            payload,
        )


def test_the_publish_keeps_each_attempts_plain_parts(redis_client: redis.Redis) -> None:
    """The worker's publish builds a plain item's keys and line head once per attempt:
    its lines are ``step_line``'s, a new attempt or worker gets its own, a lease that is
    not the worker's is written out, and an attempt's last publish forgets them."""
    keys = Keys("tp:")
    store = RequestStore(redis_client, keys)

    def item(attempt: int, ordinal: int, lease: str = "", done: bool = False) -> PublishItem:
        lease = lease or lease_value("w1", attempt)
        return PublishItem("r1", lease, attempt, b"[5]", refresh=False, ordinal=ordinal, done=done)

    def plain_lines(items: list[PublishItem], worker: str = "w1") -> tuple[list[bytes], list[str]]:
        key_list, args, _order, plain, _keys = store._publish_args(
            items, 30.0, worker, "1.5", "", keys
        )
        return (args[6].split(b"\n") if plain else []), key_list

    lines, key_list = plain_lines([item(0, 7)])
    assert b"\n".join(lines) == step_line(keys.tokens("r1"), 0, 7, b"[5]")
    assert key_list[-3:-1] == [keys.lease("r1"), keys.cancel("r1")]
    assert b"\n".join(plain_lines([item(0, 8)])[0]) == step_line(keys.tokens("r1"), 0, 8, b"[5]")
    assert b"\n".join(plain_lines([item(1, 9)])[0]) == step_line(keys.tokens("r1"), 1, 9, b"[5]")
    assert plain_lines([item(1, 10, lease="w2:1")])[0] == []  # not the worker's lease
    lease_w2 = lease_value("w2", 1)
    assert plain_lines([item(1, 10, lease=lease_w2)], worker="w2")[0]  # another worker's own
    assert "r1" in store._plain_parts
    plain_lines([item(1, 11, done=True)])
    assert "r1" not in store._plain_parts
