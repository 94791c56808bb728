"""Fixtures for the web tier's unit tests: the real Flask app with a real
``broker.runner.Runner`` on a real redis-server, and no worker or streamer processes.

Instead of a streamer, a test writes a request's output events itself
(``ScriptedOutput``) through ``broker.outputs.OutputStreams`` — the same entries a
streamer writes — so every framing rule is tested on the real read path. Request ids
are chosen by the test (the runner's ``new_id``), so it can write a request's output
before sending the request: the web tier reads output streams from ``0-0``. Since the
runner refuses requests when no worker or streamer is alive (fail fast), the fixtures
register one of each in the registry, as those processes' heartbeats would
(``LiveFleet``); a test removes them to see the 503.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from app.messages import FinishReason, OutputEvent, OutputKind
from app.settings import Settings
from broker.keys import Keys
from broker.models import ModelEntry
from broker.outputs import OutputEntry, OutputStreams
from broker.registry import StreamerInfo, WorkerInfo, streamer_registry, worker_registry
from broker.requests import RequestStore
from broker.runner import Runner
from tests.integration.conftest import redis_server  # noqa: F401
from tests.stack import isolated_settings
from web.app import create_app


class RequestIds:
    """The service's ``new_id``: hands out ids the test knows in advance."""

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.issued: list[str] = []

    def peek(self) -> str:
        """The id the next request will get."""
        return f"{self._prefix}-{len(self.issued)}"

    def __call__(self) -> str:
        rid = self.peek()
        next(self._counter)
        self.issued.append(rid)
        return rid


class ScriptedOutput:
    """Writes output events for a request, as a streamer would."""

    def __init__(self, settings: Settings) -> None:
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.keys = Keys(settings.key_prefix)
        self.streams = OutputStreams(self.redis, self.keys)
        self.store = RequestStore(self.redis, self.keys)

    def write(self, rid: str, *events: OutputEvent) -> None:
        self.streams.write([OutputEntry(rid, list(events), "0-0", first=True)])

    def cancelled(self, rid: str) -> bool:
        return self.store.is_cancelled(rid)

    def in_flight(self) -> list[str]:
        return [m.decode() for m in self.redis.zrange(self.keys.inflight, 0, -1)]


def delta(choice: int, text: str, **kw: object) -> OutputEvent:
    return OutputEvent(OutputKind.DELTA, choice, text, **kw)  # type: ignore[arg-type]


def final(
    choice: int, reason: FinishReason = FinishReason.STOP, stop: int | str | None = None
) -> OutputEvent:
    return OutputEvent(OutputKind.FINAL, choice, finish_reason=reason, stop_reason=stop)


def usage(prompt: int = 5, completion: int = 2) -> OutputEvent:
    return OutputEvent(
        OutputKind.USAGE,
        usage={
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "timings": {"queue_s": 0.01, "ttft_s": 0.01, "decode_s": 0.1, "e2e_s": 0.2},
            "streamer": "s1",
        },
    )


def error(message: str, code: int, choice: int | None = None) -> OutputEvent:
    if choice is not None:
        return OutputEvent(
            OutputKind.FINAL, choice, finish_reason=FinishReason.ERROR, error=message, code=code
        )
    return OutputEvent(OutputKind.ERROR, error=message, code=code)


@pytest.fixture
def settings(redis_server, models_dir) -> Settings:  # type: ignore[no-untyped-def]  # noqa: F811
    return isolated_settings(redis_server.url, models_dir, sse_keepalive_s=0.2)


@pytest.fixture
def ids() -> RequestIds:
    return RequestIds()


class LiveFleet:
    """A worker for the served model and a streamer, as their heartbeats register them
    (registration entries only: these tests script the output themselves)."""

    def __init__(self, settings: Settings) -> None:
        client = redis.Redis.from_url(settings.redis_url)
        keys = Keys(settings.key_prefix)
        self.workers = worker_registry(client, keys, ttl_s=3600)
        self.streamers = streamer_registry(client, keys, ttl_s=3600)
        self.worker = WorkerInfo(
            worker_id="w-test",
            model=settings.served_name,
            engine="scripted",
            capacity=8,
            hostname="test",
            pid=0,
            started=0.0,
        )
        self.streamer = StreamerInfo(streamer_id="s-test", hostname="test", pid=0, started=0.0)
        self.workers.heartbeat(self.worker)
        self.streamers.heartbeat(self.streamer)

    def serve(self, model: str, model_dir: Path, *, worker_id: str | None = None) -> WorkerInfo:
        """A live worker of another model, with the entry its worker writes
        (``broker.models``): its card is read from ``model_dir``."""
        info = self.worker.model_copy(
            update={"worker_id": worker_id or f"w-{model}", "model": model}
        )
        self.workers.heartbeat(info)
        entry = ModelEntry(
            name=model, model_dir=str(model_dir), engine="scripted", context_length=8192
        )
        self.workers.redis.hset(self.workers.keys.models, model, entry.model_dump_json())
        return info

    def stop_workers(self) -> None:
        self.workers.unregister(self.worker.member_id)

    def stop_streamers(self) -> None:
        self.streamers.unregister(self.streamer.member_id)


@pytest.fixture
def fleet(settings: Settings) -> LiveFleet:
    return LiveFleet(settings)


@pytest.fixture
def service(settings: Settings, ids: RequestIds, fleet: LiveFleet) -> Iterator[Runner]:
    runner = Runner(settings, new_id=ids)
    yield runner
    runner.hub.close()  # its reader's connection, which outlives the reader otherwise


@pytest.fixture
def app(settings: Settings, service: Runner) -> Flask:
    flask_app = create_app(settings, runner=service)
    flask_app.testing = True
    return flask_app


@pytest.fixture
def client(app: Flask) -> Iterator[FlaskClient]:
    with app.test_client() as c:
        yield c


@pytest.fixture
def scripted(settings: Settings) -> ScriptedOutput:
    return ScriptedOutput(settings)


@pytest.fixture
def make_client(
    settings: Settings, ids: RequestIds, fleet: LiveFleet
) -> Callable[..., tuple[FlaskClient, Runner]]:
    """A client for an app with some settings changed, and its ``Runner``."""

    def make(**overrides: Any) -> tuple[FlaskClient, Runner]:
        s = settings.model_copy(update=overrides)
        runner = Runner(s, new_id=ids)
        flask_app = create_app(s, runner=runner)
        flask_app.testing = True
        return flask_app.test_client(), runner

    return make
