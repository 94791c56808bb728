"""The pipeline without the web tier, as tests drive it: write requests the way the web
tier does, read their output streams, and compute what they must produce (the echo
engine run in-process, then the Decoder alone on its ids). Shared by the pipeline's
integration tests and the fault suites."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from tokenizers import Tokenizer

from app.decoder import RequestDecoder
from app.messages import FinishReason, OutputEvent, OutputKind
from app.records import RequestRecord
from app.settings import Settings
from broker.celery_app import create_celery
from broker.keys import Keys
from broker.outputs import OutputStreams, decode_events, is_terminal
from broker.requests import RequestStore
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.echo import EchoEngine

EOS = 2
TEXT = "The quick brown fox 🦊 jumps over the lazy dog; 東京 is far. END of story, friend."


@dataclass
class Result:
    texts: dict[int, str] = field(default_factory=dict)
    finals: dict[int, OutputEvent] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    errors: list[OutputEvent] = field(default_factory=list)
    deltas: int = 0


def collect(events: Iterator[OutputEvent]) -> Result:
    r = Result()
    for ev in events:
        if ev.kind is OutputKind.DELTA:
            assert ev.choice is not None and ev.choice not in r.finals
            r.texts[ev.choice] = r.texts.get(ev.choice, "") + ev.text
            r.deltas += 1
        elif ev.kind is OutputKind.FINAL:
            assert ev.choice is not None and ev.choice not in r.finals
            r.finals[ev.choice] = ev
        elif ev.kind is OutputKind.USAGE:
            r.usage = ev.usage
        else:
            r.errors.append(ev)
    return r


def reference(tokenizer: Tokenizer, record: RequestRecord) -> Result:
    """The echo engine run in-process, then the Decoder alone on its ids."""
    engine = EchoEngine()
    for p, prompt in enumerate(record.prompts):
        engine.submit(
            EngineJob(
                job_id=str(p),
                prompt_ids=prompt,
                choices=[ChoiceJob(p * record.n + i, record.max_tokens) for i in range(record.n)],
                eos_token_ids=frozenset(
                    () if record.stop.ignore_eos else record.stop.eos_token_ids
                ),
                stop_token_ids=frozenset(record.stop.stop_token_ids),
                min_tokens=record.stop.min_tokens,
            )
        )
    decoders = RequestDecoder.for_record(tokenizer, record)
    events: list[OutputEvent] = []
    while engine.has_work():
        for s in engine.step():
            events += decoders.feed(s.delta)
    result = collect(iter(events))
    result.usage = decoders.usage
    return result


class Client:
    """Writes requests the way the web tier does and reads their output streams."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        client = redis.Redis.from_url(settings.redis_url)
        self.redis = client
        self.store = RequestStore(client, Keys(settings.key_prefix))
        self.outputs = OutputStreams(client, Keys(settings.key_prefix))
        self.celery = create_celery(settings)

    def submit(self, record: RequestRecord) -> None:
        self.store.submit(record, self.celery)

    def events(self, rid: str, timeout_s: float = 30) -> Iterator[OutputEvent]:
        for _eid, ev in self.outputs.follow(rid, timeout_s=timeout_s):
            yield ev

    def run(self, record: RequestRecord, timeout_s: float = 30) -> Result:
        self.submit(record)
        return collect(self.events(record.request_id, timeout_s))


@dataclass
class Followed:
    """One request followed by an ``OutageReader``."""

    record: RequestRecord
    n: int = 0  # the last output chunk read
    events: list[OutputEvent] = field(default_factory=list)
    first_text_at: float | None = None  # time.monotonic() of its first text
    ended_at: float | None = None  # time.monotonic() of its terminal event

    @property
    def result(self) -> Result:
        return collect(iter(self.events))


class OutageReader:
    """Follows many output streams from the chunks they have read, and keeps going
    through a Redis outage (as a web tier that survives its backbone does): a failed
    read is retried after a short pause, from the same chunk. Each request's output is
    read whole each time (``OutputStreams.read_log``: the stream and its tail), which
    checks the record every reader off the hot path relies on, every 20 ms."""

    def __init__(self, settings: Settings) -> None:
        self.redis = redis.Redis.from_url(settings.redis_url, socket_timeout=5)
        self.keys = Keys(settings.key_prefix)
        self.outputs = OutputStreams(self.redis, self.keys)
        self.followed: dict[str, Followed] = {}

    def follow(self, record: RequestRecord) -> Followed:
        f = self.followed[self.keys.output(record.request_id)] = Followed(record)
        return f

    def open(self) -> list[Followed]:
        return [f for f in self.followed.values() if f.ended_at is None]

    def poll(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Read until every stream ended, ``stop()`` says so, or ``until`` (monotonic)."""
        while self.open() and time.monotonic() < until and not (stop and stop()):
            for f in self.open():
                try:
                    chunks = self.outputs.read_log(f.record.request_id, f.n).chunks
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.1)
                    break
                now = time.monotonic()
                for n, raw in chunks:  # a gap (Redis lost data) shows in the text
                    f.n = n
                    for ev in decode_events(raw):
                        f.events.append(ev)
                        if ev.text and f.first_text_at is None:
                            f.first_text_at = now
                        if is_terminal(ev):
                            f.ended_at = now
            time.sleep(0.02)


def classify(f: Followed, want: Result) -> str:
    """``exact`` (the whole reference text), ``error`` (a clear error event, and no text
    that is not a prefix of the reference: nothing lost or repeated before it), ``hung``
    (no terminal event), or ``wrong``."""
    if f.ended_at is None:
        return "hung"
    got = f.result
    failed = bool(got.errors) or any(
        fin.finish_reason is FinishReason.ERROR for fin in got.finals.values()
    )
    if not failed:
        return "exact" if got.texts == want.texts else "wrong"
    prefixes = all(want.texts.get(c, "").startswith(t) for c, t in got.texts.items())
    return "error" if prefixes else "wrong"
