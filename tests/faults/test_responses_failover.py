"""Background responses outlive the web process that created them (issue 14's acceptance).

Real processes: one redis-server, a Celery worker (echo engine at 25 tokens/s, so the
reply below takes seconds), a streamer, and two web servers: A, started per test, and
B, shared by the module. A background response is created on A through the openai SDK;
then A's whole process group (gunicorn master and workers, as we started it) is
SIGKILLed mid-generation, by its PID. Nothing follows the generation any more on A, yet
it must run to its end, and B must serve it exactly:

- streamed: the client read part of the events on A and resumes on B with
  ``starting_after`` = the last sequence number it saw; A's events plus B's are one
  gapless sequence whose text is exactly the echoed text, ending ``response.completed``;
- polled: the client only polls, on B; the response completes with the exact text,
  folded by B from the output stream since A (which would have written it) is dead.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from app.settings import Settings
from broker.keys import Keys
from broker.requests import RequestStore
from broker.server import RedisServer
from tests.stack import (
    Proc,
    isolated_settings,
    streamer_process,
    wait_for,
    web_process,
    web_settings,
    worker_process,
)

pytestmark = pytest.mark.faults

logger = logging.getLogger(__name__)

RATE = 25.0  # echo tokens per second: the reply below takes ~5 s
TEXT = " ".join(
    f"part {i}: the quick brown fox 🦊 jumps over the lazy dog; 東京 is far." for i in range(4)
)
READ_BEFORE_FAULT = 8  # text deltas read on A before the fault
WAIT_S = 30.0  # bound of every wait


@dataclass
class Web:
    url: str
    proc: Proc
    clients: list[openai.OpenAI] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        """A client of this web process, closed by its fixture (``close``). One left to
        the garbage collector is a cycle: its sockets may be finalized before the client
        closes them, a ResourceWarning (an error here) in whatever test runs then."""
        c = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S
        )
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def kill_group(self) -> None:
        """SIGKILL the gunicorn master and its workers: the group we started it in
        (``start_new_session``), by its PID, never by name."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.popen.wait(10)
        logger.info("killed web process group %s", self.proc.pid)


@dataclass
class Backbone:
    settings: Settings
    logs: Path
    b: Web


def base(settings: Settings) -> str:
    return f"http://{settings.host}:{settings.port}"


@pytest.fixture(scope="module")
def backbone(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backbone]:
    logs = tmp_path_factory.mktemp("responses-failover-logs")
    with RedisServer() as server:
        settings = isolated_settings(
            server.url,
            models_dir,
            echo_tokens_per_second=RATE,
            # A disconnect cancels at once: only the background follower may keep the
            # generation alive, which is what these tests check.
            resume_grace_s=0.0,
            sse_keepalive_s=0.5,
            web_workers=2,
            web_threads=8,
        )
        b_settings = web_settings(settings)
        with (
            worker_process(settings, logs),
            streamer_process(settings, logs),
            web_process(b_settings, logs, name="web-b") as b,
        ):
            web_b = Web(base(b_settings), b)
            try:
                yield Backbone(settings, logs, web_b)
            finally:
                web_b.close()


@pytest.fixture
def web_a(backbone: Backbone) -> Iterator[Web]:
    a_settings = web_settings(backbone.settings)
    with web_process(a_settings, backbone.logs, name="web-a") as proc:
        web = Web(base(a_settings), proc)
        try:
            yield web
        finally:
            web.close()


def in_flight(settings: Settings) -> int:
    """Requests holding an admission slot right now."""
    client = redis.Redis.from_url(settings.redis_url)
    try:
        return RequestStore(client, Keys(settings.key_prefix)).in_flight(time.time())
    finally:
        client.close()


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_background_stream_resumes_on_another_web_process(backbone: Backbone, web_a: Web) -> None:
    model = backbone.settings.served_name
    head: list[Any] = []
    stream = web_a.client().responses.create(model=model, input=TEXT, background=True, stream=True)
    for event in stream:
        head.append(event)
        if sum(e.type == "response.output_text.delta" for e in head) >= READ_BEFORE_FAULT:
            break
    web_a.kill_group()
    killed_at = time.monotonic()
    stream.close()
    response_id = head[0].response.id
    last = head[-1].sequence_number
    assert 0 < len(text_of(head)) < len(TEXT)
    tail: list[Any] = []
    first_after = 0.0
    with backbone.b.client().responses.stream(response_id=response_id, starting_after=last) as rest:
        for event in rest:
            first_after = first_after or time.monotonic() - killed_at
            tail.append(event)
        final = rest.get_final_response()
    logger.info(
        "first event on B %.2f s after the kill; finished %.2f s after it",
        first_after,
        time.monotonic() - killed_at,
    )
    assert first_after < 5.0  # B replays what is in Redis at once
    assert [e.sequence_number for e in head + tail] == list(range(len(head) + len(tail)))
    assert text_of(head) + text_of(tail) == TEXT
    assert tail[-1].type == "response.completed" and final.output_text == TEXT
    stored = backbone.b.client().responses.retrieve(response_id)
    assert stored.status == "completed" and stored.output_text == TEXT
    assert in_flight(backbone.settings) == 0


def test_polled_background_response_completes_after_its_web_process_died(
    backbone: Backbone, web_a: Web
) -> None:
    model = backbone.settings.served_name
    created = web_a.client().responses.create(model=model, input=TEXT, background=True)
    assert created.status == "queued"
    b = backbone.b.client()

    def some_output() -> Any:
        r = b.responses.retrieve(created.id)
        return r if len(r.output_text) > 10 else None

    partial = wait_for(some_output, WAIT_S, "some output")
    # Killed mid-generation: A has not written the final object.
    assert partial.status == "in_progress" and TEXT.startswith(partial.output_text)
    assert len(partial.output_text) < len(TEXT)
    web_a.kill_group()

    def finished() -> Any:
        r = b.responses.retrieve(created.id)
        return r if r.status not in ("queued", "in_progress") else None

    done = wait_for(finished, WAIT_S, "a terminal status", interval=0.2)
    assert done.status == "completed" and done.output_text == TEXT
    assert done.usage is not None and done.usage.output_tokens > 0
    # A's follower never freed the admission slot; B did when it saw the end.
    assert in_flight(backbone.settings) == 0
