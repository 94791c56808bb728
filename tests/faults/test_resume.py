"""Client loss: a client whose web process dies mid-stream resumes on another one.

Real processes: one redis-server, a Celery worker (echo engine at a finite rate, so a
reply takes seconds), a streamer, and two web servers on different ports that differ
only in their port: A, started for each test, and B, shared by the module. A stream
starts on A; part of it is read; then A's whole process group (gunicorn master and
workers, as we started it) is SIGKILLed, or the socket is just dropped. The client
resumes on B from the last event it saw completely (SSE ``Last-Event-ID``, WebSocket
``resume`` with the cursor) and what A sent plus what B sends is exactly the echoed
text, ending with a finish and ``[DONE]`` (SSE) or usage and ``done`` (WebSocket).
A finished request replays on B from the start, event for event.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import websocket

from tests.faults.conftest import TEXT, WAIT_S, Backbone, Web

pytestmark = pytest.mark.faults

logger = logging.getLogger(__name__)

READ_BEFORE_FAULT = 8  # content events read on A before the fault
GRACE_S = 30.0  # resume_grace_s: far longer than any test here takes to resume


@pytest.fixture(scope="module")
def resume_grace_s() -> float:
    """The backbone's (``tests.faults.conftest``): a client has long to resume."""
    return GRACE_S


# -- SSE ----------------------------------------------------------------------------------


@dataclass
class SseRead:
    """The complete events one SSE connection delivered: (id, payload) in order."""

    events: list[tuple[str | None, Any]] = field(default_factory=list)
    first_at: float | None = None  # when the first event arrived (monotonic)
    done: bool = False
    broken: bool = False  # the connection ended without [DONE]

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [p for _, p in self.events]

    @property
    def last_id(self) -> str | None:
        ids = [i for i, _ in self.events if i]
        return ids[-1] if ids else None

    def text(self) -> str:
        return "".join(
            c["delta"].get("content") or "" for p in self.chunks for c in p.get("choices", [])
        )

    def contents(self) -> int:
        choices = [c for p in self.chunks for c in p.get("choices", [])]
        return sum(1 for c in choices if c["delta"].get("content"))


def read_sse(resp: requests.Response, read: SseRead, *, until_contents: int | None = None) -> None:
    """Add ``resp``'s complete events to ``read`` (a half-received event is dropped, as
    a browser's EventSource drops it) until ``[DONE]``, the connection's end, or
    ``until_contents`` content events, within WAIT_S (keep-alives arrive every half
    second, so a stream that never ends fails here instead of hanging the test)."""
    deadline = time.monotonic() + WAIT_S
    lines: list[str] = []
    try:
        for raw in resp.iter_lines(decode_unicode=False):
            assert time.monotonic() < deadline, f"the stream did not end: {read.events[-2:]}"
            line = raw.decode("utf-8")
            if line:
                lines.append(line)
                continue
            event_id, data = None, None
            for ln in lines:
                if ln.startswith("id: "):
                    event_id = ln[4:]
                elif ln.startswith("data: "):
                    data = ln[6:]
            lines = []
            if data is None:  # a keep-alive comment
                continue
            if data == "[DONE]":
                read.done = True
                return
            payload = json.loads(data)
            assert "error" not in payload, payload
            read.events.append((event_id, payload))
            read.first_at = read.first_at or time.monotonic()
            if until_contents is not None and read.contents() >= until_contents:
                return
    except requests.RequestException as exc:  # the server died under us
        logger.info("SSE connection ended: %r", exc)
    read.broken = True


def stream_chat(url: str) -> requests.Response:
    resp = requests.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": TEXT}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        stream=True,
        timeout=(5, WAIT_S),
    )
    assert resp.status_code == 200, resp.text
    return resp


def resume_sse(url: str, rid: str, last_id: str | None) -> tuple[SseRead, float]:
    """GET /v1/streams/<rid> after ``last_id``; everything it sent, and how long."""
    started = time.monotonic()
    headers = {"Last-Event-ID": last_id} if last_id else {}
    with requests.get(
        f"{url}/v1/streams/{rid}", headers=headers, stream=True, timeout=(5, WAIT_S)
    ) as resp:
        assert resp.status_code == 200, resp.text
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        read = SseRead()
        read_sse(resp, read)
    return read, time.monotonic() - started


def usage_and_finish(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    finishes = [c["finish_reason"] for p in chunks for c in p["choices"] if c["finish_reason"]]
    usages = [p["usage"] for p in chunks if p.get("usage")]
    assert len(finishes) == 1 and len(usages) == 1, chunks[-3:]
    return usages[0], finishes[0]


@pytest.mark.timeout(120)
def test_sse_resumes_on_another_web_process_after_a_sigkill(backbone: Backbone, web_a: Web) -> None:
    resp = stream_chat(web_a.url)
    rid = resp.headers["x-request-id"]
    on_a = SseRead()
    read_sse(resp, on_a, until_contents=READ_BEFORE_FAULT)
    assert on_a.contents() == READ_BEFORE_FAULT and not on_a.done
    assert on_a.chunks[0]["id"] == f"chatcmpl-{rid}"
    assert on_a.chunks[0]["choices"][0]["delta"]["role"] == "assistant"

    web_a.kill_group()
    killed = time.monotonic()
    read_sse(resp, on_a)  # whatever A had already sent, up to the broken connection
    resp.close()
    assert on_a.broken and not on_a.done, "A died: its stream cannot have ended cleanly"
    assert TEXT.startswith(on_a.text()) and on_a.text() != TEXT

    on_b, took = resume_sse(backbone.b.url, rid, on_a.last_id)
    assert on_b.first_at is not None
    recovered = on_b.first_at - killed
    assert on_b.done and not on_b.broken
    assert on_a.text() + on_b.text() == TEXT
    assert all(c["id"] == f"chatcmpl-{rid}" for c in on_b.chunks)
    assert not any("role" in c["delta"] for p in on_b.chunks for c in p["choices"])
    usage, finish = usage_and_finish(on_b.chunks)
    assert finish == "stop"
    assert usage["completion_tokens"] > READ_BEFORE_FAULT
    logger.info("first event on B %.2f s after the kill (B's stream: %.2f s)", recovered, took)
    assert recovered < 5.0

    # The whole request replays from the start on B: A's events then B's, id for id.
    replay, _ = resume_sse(backbone.b.url, rid, None)
    assert replay.done
    assert replay.events == on_a.events + on_b.events


@pytest.mark.timeout(120)
def test_a_finished_stream_replays_on_another_process_exactly(
    backbone: Backbone, web_a: Web
) -> None:
    with stream_chat(web_a.url) as resp:
        rid = resp.headers["x-request-id"]
        original = SseRead()
        read_sse(resp, original)
    assert original.done and original.text() == TEXT

    replay, _ = resume_sse(backbone.b.url, rid, None)
    assert replay.done
    assert replay.events == original.events

    # From the middle: exactly the rest. From the last event (the usage chunk): at once
    # [DONE], nothing else -- the client had everything but the end marker.
    middle = len(original.events) // 2
    rest, _ = resume_sse(backbone.b.url, rid, original.events[middle][0])
    assert rest.events == original.events[middle + 1 :]
    nothing, took = resume_sse(backbone.b.url, rid, original.last_id)
    assert nothing.done and nothing.events == []
    assert took < 3.0, f"resuming after the last event took {took:.1f} s"

    missing = requests.get(f"{backbone.b.url}/v1/streams/{'0' * 32}", timeout=5)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "stream_not_found"
    # Not an id at all; a Messages event's id (``<cursor>/<k>``) for a chat stream.
    for wrong in ("nonsense", f"{original.events[middle][0]}/0"):
        bad = requests.get(
            f"{backbone.b.url}/v1/streams/{rid}", headers={"Last-Event-ID": wrong}, timeout=5
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_event_id"


# -- WebSocket ----------------------------------------------------------------------------


@dataclass
class WsRead:
    """What one WebSocket delivered for one client id."""

    started: list[str] = field(default_factory=list)  # request ids
    deltas: list[dict[str, Any]] = field(default_factory=list)
    finals: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    broken: bool = False

    @property
    def cursor(self) -> str | None:
        cursors = [m["cursor"] for m in self.deltas + self.finals if "cursor" in m]
        return max(cursors, key=cursor_key) if cursors else None

    def text(self) -> str:
        return "".join(d["text"] for d in self.deltas)


def cursor_key(cursor: str) -> tuple[int, int]:
    chunk, _, index = cursor.partition("/")
    return int(chunk), int(index)


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://", 1) + "/v1/ws"


def read_ws(ws: websocket.WebSocket, read: WsRead, *, until_deltas: int | None = None) -> None:
    """Add the messages for our id to ``read`` until ``done``, the connection's end or
    ``until_deltas`` non-empty deltas; each receive is bounded by the socket timeout."""
    try:
        while not read.done:
            msg = json.loads(ws.recv())
            kind = msg["type"]
            assert msg.get("id") == "q", msg
            if kind == "started":
                read.started.append(msg["request_id"])
            elif kind == "delta":
                assert "cursor" in msg, msg
                read.deltas.append(msg)
            elif kind == "final":
                read.finals.append(msg)
            elif kind == "usage":
                read.usage = msg["usage"]
            elif kind == "error":
                read.errors.append(msg)
            elif kind == "done":
                read.done = True
            texts = sum(1 for d in read.deltas if d["text"])
            if until_deltas is not None and texts >= until_deltas:
                return
    except (websocket.WebSocketException, OSError) as exc:
        logger.info("WebSocket ended: %r", exc)
        read.broken = True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["sigkill_web", "drop_socket"])
def test_websocket_resumes_on_another_web_process(
    backbone: Backbone, web_a: Web, fault: str
) -> None:
    ws = websocket.create_connection(ws_url(web_a.url), timeout=WAIT_S)
    chat = {"type": "chat", "id": "q", "messages": [{"role": "user", "content": TEXT}]}
    ws.send(json.dumps(chat))
    on_a = WsRead()
    read_ws(ws, on_a, until_deltas=READ_BEFORE_FAULT)
    (rid,) = on_a.started
    assert not on_a.done and TEXT.startswith(on_a.text())

    if fault == "sigkill_web":
        web_a.kill_group()
        read_ws(ws, on_a)  # what A had sent before it died
        assert on_a.broken and not on_a.done
    ws.close()  # a socket whose peer is dead closes at once
    ws.shutdown()  # type: ignore[no-untyped-call]
    assert on_a.text() != TEXT

    resumed = websocket.create_connection(ws_url(backbone.b.url), timeout=WAIT_S)
    try:
        resumed.send(
            json.dumps({"type": "resume", "id": "q", "request_id": rid, "cursor": on_a.cursor})
        )
        on_b = WsRead()
        read_ws(resumed, on_b)
    finally:
        resumed.close()
    assert on_b.done and not on_b.errors, on_b.errors
    assert on_b.started == [rid]
    assert on_a.text() + on_b.text() == TEXT
    assert [f["finish_reason"] for f in on_a.finals + on_b.finals] == ["stop"]
    assert on_b.usage is not None and on_b.usage["completion_tokens"] > READ_BEFORE_FAULT
    # Cursors only grow across the two sockets: nothing was delivered twice.
    cursors = [m["cursor"] for m in on_a.deltas + on_b.deltas + on_b.finals]
    assert cursors == sorted(cursors, key=cursor_key) and len(set(cursors)) == len(cursors)
