"""No poison pills: one bad request is one bad request.

A real worker (echo engine at a finite rate) and a real streamer; bad input is injected
into one running request's token stream (as a buggy or hostile worker would write it).
That request, or only the affected choice for a decoder fault (``finish_reason:
"error"``, as Dynamo's ``backend.rs``), ends with a clear error; the streamer process
keeps running and every other request still gets exactly its text."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer

from app.messages import FinishReason, OutputKind, TokenDelta
from app.records import RequestRecord
from app.settings import Settings
from broker.requests import encode_deltas
from broker.server import RedisServer
from tests.pipeline import TEXT, Client, OutageReader, classify, reference
from tests.stack import Proc, isolated_settings, make_record, streamer_process, worker_process

pytestmark = pytest.mark.integration


class PoisonStack:
    def __init__(self, settings: Settings, streamer: Proc, tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.streamer = streamer
        self.client = Client(settings)
        self.ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
        self.tokenizer = tokenizer

    def record(self, n: int = 1) -> RequestRecord:
        return make_record(self.settings, [self.ids], n=n, max_tokens=200)

    def inject(self, rid: str, payload: Any) -> None:
        """XADD one entry into ``rid``'s token stream, as a worker would (attempt 0)."""
        self.client.redis.xadd(
            self.client.store.keys.tokens(rid), {"a": 0, "t": repr(time.time()), "d": payload}
        )


@pytest.fixture(scope="module")
def stack(
    models_dir: Path, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PoisonStack]:
    logs = tmp_path_factory.mktemp("poison-logs")
    with RedisServer() as server:
        settings = isolated_settings(server.url, models_dir, echo_tokens_per_second=15.0)
        with worker_process(settings, logs), streamer_process(settings, logs) as streamer:
            yield PoisonStack(settings, streamer, tokenizer)


def run_with_injection(stack: PoisonStack, victim: RequestRecord, payload: Any) -> OutageReader:
    """Start ``victim`` and a bystander; once the victim streams, inject ``payload`` into
    its token stream; read both to their ends."""
    bystander = stack.record()
    reader = OutageReader(stack.settings)
    for r in (victim, bystander):
        stack.client.submit(r)
        reader.follow(r)
    v = reader.followed[stack.client.store.keys.output(victim.request_id)]
    reader.poll(time.monotonic() + 20, stop=lambda: any(e.text for e in v.events))
    assert any(e.text for e in v.events), "the victim never streamed"
    stack.inject(victim.request_id, payload)
    reader.poll(time.monotonic() + 20)
    return reader


def assert_still_serving(stack: PoisonStack, reader: OutageReader) -> None:
    assert stack.streamer.alive(), stack.streamer.output()
    want = reference(stack.tokenizer, stack.record())
    others = [f for f in reader.followed.values() if f.record.n == 1][-1:]
    assert [classify(f, want) for f in others] == ["exact"], stack.streamer.output()
    after = stack.record()
    stack.client.submit(after)
    f = reader.follow(after)
    reader.poll(time.monotonic() + 20)
    assert classify(f, want) == "exact", stack.streamer.output()


def request_error(
    stack: PoisonStack, reader: OutageReader, record: RequestRecord
) -> tuple[int | None, str]:
    """The poisoned request ended with one request-level error, its choices closed with
    ``finish_reason: error``, and no text that is not a prefix of the right one."""
    f = reader.followed[reader.keys.output(record.request_id)]
    assert f.ended_at is not None, "the poisoned request hangs"
    assert classify(f, reference(stack.tokenizer, record)) == "error"
    result = f.result
    (err,) = result.errors
    assert err.kind is OutputKind.ERROR and err.choice is None
    assert all(fin.finish_reason is FinishReason.ERROR for fin in result.finals.values())
    return err.code, err.error or ""


def test_malformed_token_entry_ends_only_its_request(stack: PoisonStack) -> None:
    victim = stack.record()
    reader = run_with_injection(stack, victim, b"this is not JSON")
    code, message = request_error(stack, reader, victim)
    assert code == 500 and "streamer failed" in message
    assert_still_serving(stack, reader)


def test_invalid_choice_index_ends_only_its_request(stack: PoisonStack) -> None:
    victim = stack.record()
    reader = run_with_injection(stack, victim, encode_deltas([TokenDelta(7, [100])]))
    code, _message = request_error(stack, reader, victim)
    assert code == 500
    assert_still_serving(stack, reader)


def test_decoder_fault_ends_only_that_choice(stack: PoisonStack) -> None:
    """A token id the detokenizer rejects ends choice 1 with ``finish_reason: error``;
    choice 0 of the same request still gets exactly its text."""
    victim = stack.record(n=2)
    bad = orjson.dumps([TokenDelta(1, [-1]).encode()])
    reader = run_with_injection(stack, victim, bad)
    f = reader.followed[reader.keys.output(victim.request_id)]
    result = f.result
    want = reference(stack.tokenizer, victim)
    assert f.ended_at is not None and not result.errors
    assert result.finals[1].finish_reason is FinishReason.ERROR
    assert "could not decode" in (result.finals[1].error or "")
    assert result.finals[0].finish_reason is want.finals[0].finish_reason
    assert result.texts[0] == want.texts[0]
    assert want.texts[1].startswith(result.texts.get(1, ""))
    assert result.usage is not None
    assert_still_serving(stack, reader)
