"""Stored responses on a real redis-server: owners, TTL, the write-once final object, and
settling an unfinished response from its output stream (what any web process does when
the one that created it is gone)."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from app.messages import FinishReason, OutputEvent, OutputKind
from app.responses_api import ResponseSkeleton, parse_responses_request, response_id_of
from app.settings import Settings
from broker.keys import Keys
from broker.outputs import OutputEntry, OutputStreams
from broker.requests import RequestStore
from broker.responses import LOST_MESSAGE, ResponseStore, StoredResponse
from tests.stack import make_record

pytestmark = pytest.mark.integration

TTL_S = 3600


@pytest.fixture
def responses(redis_client: redis.Redis, settings: Settings, store: RequestStore) -> ResponseStore:
    keys = Keys(settings.key_prefix)
    return ResponseStore(
        redis_client,
        keys,
        ttl_s=TTL_S,
        requests=store,
        outputs=OutputStreams(redis_client, keys, ttl_s=600),
    )


def stored_for(rid: str, *, owner: str = "o1", background: bool = True) -> StoredResponse:
    req = parse_responses_request({"input": "Hi", "background": background})
    base = ResponseSkeleton(response_id_of(rid), 1700000000, "m", req).base()
    status = "queued" if background else "in_progress"
    return StoredResponse(
        response_id=base["id"],
        request_id=rid,
        owner=owner,
        status=status,
        response={**base, "status": status},
        base=base,
        input_items=[{"id": "msg_1", **req.input_items[0]}],
        background=background,
    )


def write(outputs: OutputStreams, rid: str, *events: OutputEvent, first: bool = False) -> None:
    outputs.write([OutputEntry(rid, list(events), "0-0", first=first)])


def delta(text: str) -> OutputEvent:
    return OutputEvent(OutputKind.DELTA, choice=0, text=text)


USAGE = OutputEvent(
    OutputKind.USAGE, usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
)


def test_owner_scope_and_ttl(
    responses: ResponseStore, redis_client: redis.Redis, settings: Settings
) -> None:
    s = stored_for("r-scope")
    responses.create(s)
    assert responses.load(s.response_id, "o1") == s
    assert responses.load(s.response_id, None) == s
    assert responses.load(s.response_id, "o2") is None
    ttl = redis_client.ttl(Keys(settings.key_prefix).response(s.response_id))
    assert 0 < int(ttl) <= TTL_S  # type: ignore[arg-type]
    assert responses.delete(s) and responses.load(s.response_id, None) is None


def test_settle_folds_the_stream_and_finishes_once(
    responses: ResponseStore, store: RequestStore, settings: Settings
) -> None:
    record = make_record(settings, [[1, 2, 3]])
    rid = record.request_id
    store.create(record)
    s = stored_for(rid)
    responses.create(s)
    # Nothing written yet and the request is queued: still "queued".
    assert responses.settle(s).response["status"] == "queued"
    write(responses.outputs, rid, delta("Hel"), first=True)
    partial = responses.settle(s)
    assert partial.status == "in_progress" and partial.response["output"][0]["status"] == (
        "in_progress"
    )
    assert responses.load(s.response_id, None).status == "queued"  # type: ignore[union-attr]
    write(
        responses.outputs,
        rid,
        delta("lo"),
        OutputEvent(OutputKind.FINAL, choice=0, finish_reason=FinishReason.STOP),
        USAGE,
    )
    done = responses.settle(s)
    assert done.status == "completed"
    assert done.response["output"][0]["content"][0]["text"] == "Hello"
    assert done.response["usage"]["output_tokens"] == 2
    assert responses.load(s.response_id, None) == done
    # Write-once: a later finish (another process, a cancel) changes nothing.
    assert not responses.finish(s, {**done.response, "status": "cancelled"})
    assert responses.load(s.response_id, None) == done


def test_a_cancel_is_never_overwritten(responses: ResponseStore, store: RequestStore) -> None:
    s = stored_for("r-cancel")
    responses.create(s)
    assert responses.finish(s, {**s.response, "status": "cancelled"})
    write(responses.outputs, "r-cancel", delta("x"), USAGE, first=True)
    assert responses.settle(responses.load(s.response_id, None)).status == "cancelled"  # type: ignore[arg-type]


def test_lost_output_settles_failed(responses: ResponseStore) -> None:
    s = stored_for("r-lost-never-written")
    responses.create(s)
    failed = responses.settle(s)
    assert failed.status == "failed"
    assert failed.response["error"] == {"code": "server_error", "message": LOST_MESSAGE}
    assert responses.load(s.response_id, None).status == "failed"  # type: ignore[union-attr]


def test_a_conversation_is_walked_back_not_copied(responses: ResponseStore) -> None:
    def turn(rid: str, text: str, previous: str | None) -> StoredResponse:
        s = stored_for(rid, background=False)
        out = [{"type": "message", "role": "assistant", "content": [{"text": text}]}]
        response = {
            **s.response,
            "status": "completed",
            "previous_response_id": previous,
            "output": [{"type": "reasoning", "content": []}, *out],
        }
        s = s.with_response(response)
        responses.create(s)
        return s

    first = turn("c1", "one", None)
    second = turn("c2", "two", first.response_id)
    third = turn("c3", "three", second.response_id)
    items = responses.conversation(third)
    assert items is not None
    assert [i["type"] for i in items] == ["message"] * 6  # reasoning left out
    assert [i["content"][0]["text"] for i in items[1::2]] == ["one", "two", "three"]
    fields: Any = responses.redis.hkeys(responses.keys.response(third.response_id))
    assert b"input" in fields and b"context" not in fields  # no copy of the conversation
    responses.delete(second)
    assert responses.conversation(third) is None  # a gap: it cannot be continued
