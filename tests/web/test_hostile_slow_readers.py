"""Issue 16 line 12 ("a client that never reads its SSE stream makes the web worker
buffer the whole output"): per-subscription output buffers are bounded, on the real
read path (``OutputHub`` + ``Run`` on a real redis-server, output written as a
streamer writes it). A reader that stops taking is dropped after ``stream_stall_s``
with its generation cancelled and its slot freed; a slow reader that keeps taking is
never dropped and gets every event in order.
"""

from __future__ import annotations

import time

import pytest

from app.intake import Endpoint
from app.messages import OutputKind
from app.settings import Settings
from broker.run import STALLED_MESSAGE
from broker.runner import Runner
from tests.stack import isolated_settings
from tests.web.conftest import RequestIds, ScriptedOutput, delta, final, usage

BUFFER = 4096
STALL_S = 1.0
PIECE = "x" * 200  # one entry: ~250 bytes encoded


@pytest.fixture
def settings(redis_server, models_dir) -> Settings:  # type: ignore[no-untyped-def]
    return isolated_settings(
        redis_server.url,
        models_dir,
        sse_keepalive_s=0.2,
        stream_buffer_bytes=BUFFER,
        stream_stall_s=STALL_S,
    )


def test_a_reader_that_stops_taking_is_dropped_and_its_request_cancelled(
    service: Runner, scripted: ScriptedOutput, ids: RequestIds
) -> None:
    rid = ids.peek()
    run = service.start(Endpoint.COMPLETIONS, {"prompt": "x", "stream": True})
    assert run.request_id == rid and rid in scripted.in_flight()
    for i in range(400):  # ~100 KB of output, 25x the buffer; nobody reads it
        scripted.write(rid, delta(0, f"{i}:{PIECE}"))
    started = time.monotonic()
    while not scripted.cancelled(rid) and time.monotonic() - started < 10:
        time.sleep(0.05)
    waited = time.monotonic() - started
    assert scripted.cancelled(rid), "a reader that took nothing was never dropped"
    assert STALL_S <= waited + 0.5 < STALL_S + 5
    assert rid not in scripted.in_flight()  # its admission slot is free at once
    sub = run._sub
    # The process held at most the buffer plus the one entry that crossed it.
    assert sub.dropped and sub.buffered < BUFFER + 400
    item = run.next(0.1)  # the stalled reader's next read is the error, not the backlog
    assert item is not None
    assert item[1].kind is OutputKind.ERROR and item[1].error == STALLED_MESSAGE
    assert run.ended and run.failure is not None and run.failure.status == 504
    run.close()


def test_a_slow_reader_that_keeps_taking_is_never_dropped(
    service: Runner, scripted: ScriptedOutput, ids: RequestIds
) -> None:
    rid = ids.peek()
    run = service.start(Endpoint.COMPLETIONS, {"prompt": "x", "stream": True})
    n = 120  # ~30 KB written at once; read one event per 40 ms: ~5 s, 5x the stall time
    for i in range(n):
        scripted.write(rid, delta(0, f"{i}:{PIECE}"))
    scripted.write(rid, final(0), usage())
    texts: list[str] = []
    peak = 0
    while not run.ended:
        item = run.next(5.0)
        assert item is not None, "the hub stopped feeding a reader that was taking"
        peak = max(peak, run._sub.buffered)
        if item[1].kind is OutputKind.DELTA:
            texts.append(item[1].text)
        time.sleep(0.04)
    run.close()
    assert texts == [f"{i}:{PIECE}" for i in range(n)]  # every event, in order, once
    assert run.failure is None and not run._sub.dropped
    assert not scripted.cancelled(rid)
    assert peak < BUFFER + 400  # the rest waited in Redis, not in this process
