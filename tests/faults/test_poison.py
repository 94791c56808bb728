"""No poison pills: one bad request is one bad request.

A real worker (echo engine at a finite rate) and a real streamer. One running request
is served instead by a buggy worker the test plays (``BuggyWorker``: the echo engine
in-process, each step published as the engine thread publishes it), which publishes one
chunk of bad input between two steps.
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
from broker.chunks import ChunkLog
from broker.publish import PublishItem, PublishStatus, encode_deltas, lease_value
from broker.requests import ClaimResult, RequestStore
from tests.pipeline import TEXT, Client, OutageReader, classify, reference
from tests.stack import Proc, full_stack, isolated_settings, make_record
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.echo import EchoEngine

pytestmark = pytest.mark.faults


class PoisonStack:
    def __init__(self, settings: Settings, streamer: Proc, tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.streamer = streamer
        self.client = Client(settings)
        self.ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
        self.tokenizer = tokenizer

    def record(self, n: int = 1) -> RequestRecord:
        return make_record(self.settings, [self.ids], n=n, max_tokens=200)


class BuggyWorker:
    """The victim's worker, played in-process: the echo engine's steps published as the
    engine thread publishes them (a chunk each, numbered and checkpointed by a
    ``ChunkLog``, through its step stream), and, when told, a chunk of bad input."""

    def __init__(self, store: RequestStore, record: RequestRecord) -> None:
        self.store, self.rid = store, record.request_id
        store.create(record)  # handed to the streamers; no task: no real worker runs it
        assert store.claim(self.rid, 0, "buggy", 60.0, time.time()) is ClaimResult.OK
        self.engine = EchoEngine()
        self.engine.submit(
            EngineJob(
                job_id=self.rid,
                prompt_ids=record.prompts[0],
                choices=[ChoiceJob(i, record.max_tokens) for i in range(record.n)],
                eos_token_ids=frozenset(record.stop.eos_token_ids),
            )
        )
        self.log = ChunkLog()
        self.index = 0

    def publish(self, payload: bytes, done: bool = False) -> None:
        first = self.index == 0
        n, mark, prior = self.log.stage(payload, self.index, force=first or done)
        lease = lease_value("buggy", 0)
        item = PublishItem(self.rid, lease, 0, payload, first, done, True, n, mark, prior)
        (status,) = self.store.publish([item], 60.0, "buggy")
        assert status in (PublishStatus.OK, PublishStatus.CANCEL)  # a failed one is cancelled
        self.index += 1

    def step(self) -> bool:
        """One engine step, published; whether there are more."""
        deltas = [s.delta for s in self.engine.step()]
        more = self.engine.has_work()
        self.publish(encode_deltas(deltas), done=not more)
        return more


@pytest.fixture(scope="module")
def stack(
    models_dir: Path, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PoisonStack]:
    logs = tmp_path_factory.mktemp("poison-logs")
    settings = isolated_settings("redis://unused", models_dir, echo_tokens_per_second=15.0)
    with full_stack(settings, logs, web=None) as running:
        yield PoisonStack(running.settings, running.procs["streamer"], tokenizer)


def run_with_injection(stack: PoisonStack, victim: RequestRecord, payload: Any) -> OutageReader:
    """Start ``victim`` (on a ``BuggyWorker``) and a bystander (on the real worker); once
    the victim streams, its worker publishes ``payload`` as a chunk, then the rest of
    its steps; read both to their ends."""
    bystander = stack.record()
    reader = OutageReader(stack.settings)
    worker = BuggyWorker(stack.client.store, victim)
    stack.client.submit(bystander)
    for r in (victim, bystander):
        reader.follow(r)
    v = reader.followed[stack.client.store.keys.output(victim.request_id)]
    streamed = lambda: any(e.text for e in v.events)  # noqa: E731
    deadline = time.monotonic() + 20
    while not streamed() and time.monotonic() < deadline and worker.step():
        reader.poll(time.monotonic() + 0.2, stop=streamed)
    assert streamed(), "the victim never streamed"
    worker.publish(payload)
    while worker.step():
        time.sleep(0.05)  # about the real worker's pace (15 steps a second)
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
