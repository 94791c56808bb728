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
import time
from typing import Any

import pytest

from tests.faults.conftest import TEXT, WAIT_S, Backbone, Web
from tests.stack import in_flight, wait_for

pytestmark = pytest.mark.faults

logger = logging.getLogger(__name__)

READ_BEFORE_FAULT = 8  # text deltas read on A before the fault


@pytest.fixture(scope="module")
def resume_grace_s() -> float:
    """The backbone's (``tests.faults.conftest``): a disconnect cancels at once, so only
    the background follower may keep the generation alive, which is what these tests
    check."""
    return 0.0


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
