"""A flowing SSE stream is written from the output hub's thread (``web.sse_pump``).

The app runs under a small server here that does what gunicorn's gthread worker does
for a request (start_response, one chunked write per item the app yields, the last
chunk at the end, gunicorn's own ``util.write``) and hands the app its response
object as ``web.head_first.HeadFirstWorker`` does, over a socketpair whose other end
is the client. Output is scripted on a real redis-server, as a streamer writes it.
"""

from __future__ import annotations

import json
import queue
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask
from gunicorn import util
from werkzeug.test import EnvironBuilder

from app.messages import OutputEvent, OutputKind
from app.settings import Settings
from broker.outputs import MALFORMED_OUTPUT, encode_events
from broker.runner import Runner
from broker.subscription import Pumped, Subscription
from tests.web.conftest import RequestIds, ScriptedOutput, delta, final, usage
from web.app import create_app
from web.head_first import RESPONSE_KEY
from web.responses import ChunkStream
from web.sse_pump import SsePump

BODY = {"prompt": "p", "stream": True}


class ServerResponse:
    """The parts of gunicorn's ``Response`` the pump reads, writing as it writes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.headers_sent = False
        self.response_length: int | None = None
        self.chunked = True
        self.sent = 0
        self.status = ""
        self.writes = 0  # items the app's thread wrote
        self.finished_at = 0.0

    def start_response(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None):  # type: ignore[no-untyped-def]
        self.status = status
        self.headers = headers
        return self.write

    def write(self, data: bytes) -> None:
        if not self.headers_sent:
            head = "".join(f"{k}: {v}\r\n" for k, v in self.headers)
            self.sock.sendall(f"HTTP/1.1 {self.status}\r\n{head}\r\n".encode())
            self.headers_sent = True
        if data:
            self.sent += len(data)
            self.writes += 1
            util.write(self.sock, data, chunked=True)

    def close(self) -> None:
        util.write_chunk(self.sock, b"")


def serve(app: Flask, sock: socket.socket, body: dict[str, Any]) -> ServerResponse:
    """One request, as gunicorn's request thread serves it (returns when it is done)."""
    resp = ServerResponse(sock)
    environ = EnvironBuilder(
        path="/v1/completions", method="POST", json=body, environ_overrides={}
    ).get_environ()
    environ[RESPONSE_KEY] = resp
    app_iter = app(environ, resp.start_response)
    try:
        for item in app_iter:
            resp.write(item)
        resp.close()
    except OSError:
        pass  # the client is gone, as gunicorn ignores EPIPE
    finally:
        app_iter.close()  # type: ignore[attr-defined]
        resp.finished_at = time.monotonic()
    return resp


def read_body(sock: socket.socket, timeout: float = 20.0) -> str:
    """The client: the whole chunked body, decoded."""
    sock.settimeout(timeout)
    raw = b""
    while b"\r\n0\r\n\r\n" not in raw and not raw.endswith(b"\r\n\r\n0\r\n\r\n"):
        data = sock.recv(65536)
        if not data:
            break
        raw += data
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body += rest[:size]
        assert rest[size : size + 2] == b"\r\n", "a chunk's framing is broken"
        rest = rest[size + 2 :]
    return body.decode()


def events(body: str) -> list[dict[str, Any] | str]:
    out: list[dict[str, Any] | str] = []
    for block in body.split("\n\n"):
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if data:
            out.append(data[0] if data[0] == "[DONE]" else json.loads(data[0]))
        elif block.startswith(":"):
            out.append("keep-alive")
    return out


def texts(evs: list[dict[str, Any] | str]) -> list[str]:
    return [
        e["choices"][0]["text"]
        for e in evs
        if isinstance(e, dict) and e.get("choices") and e["choices"][0]["text"]
    ]


@pytest.fixture
def pump_app(settings: Settings, service: Runner) -> Flask:
    return create_app(settings.model_copy(update={"sse_pump": True}), runner=service)


def run_stream(
    app: Flask,
    script: Callable[[str], None],
    rid: str,
    *,
    client: Callable[[socket.socket], str] = read_body,
    sndbuf: int | None = None,
) -> tuple[str, ServerResponse]:
    server_end, client_end = socket.socketpair()
    if sndbuf is not None:
        server_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        client_end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    served: queue.SimpleQueue[ServerResponse] = queue.SimpleQueue()
    server = threading.Thread(target=lambda: served.put(serve(app, server_end, BODY)))
    writer = threading.Thread(target=script, args=(rid,))
    server.start()
    writer.start()
    try:
        body = client(client_end)
    finally:
        client_end.close()
        writer.join(30)
        server.join(30)
        server_end.close()
    assert not server.is_alive(), "the request thread never finished"
    return body, served.get(timeout=1)


@pytest.fixture
def script_with(scripted: ScriptedOutput) -> Callable[..., Callable[[str], None]]:
    def make(n: int, gap_s: float, piece: str = "t") -> Callable[[str], None]:
        def script(rid: str) -> None:
            time.sleep(0.1)  # the request is open and its opening written first
            for i in range(n):
                scripted.write(rid, delta(0, f"{piece}{i} "))
                if gap_s:
                    time.sleep(gap_s)
            scripted.write(rid, final(0), usage())

        return script

    return make


def test_a_flowing_stream_is_written_by_the_hub_thread_byte_for_byte(
    settings: Settings,
    service: Runner,
    ids: RequestIds,
    script_with: Callable[..., Callable[[str], None]],
) -> None:
    bodies = {}
    writes = {}
    for pump in (True, False):
        app = create_app(settings.model_copy(update={"sse_pump": pump}), runner=service)
        body, resp = run_stream(app, script_with(40, 0.01), ids.peek())
        bodies[pump], writes[pump] = body, resp.writes

    # The same events either way (ids and times differ from request to request).
    def same(body: str) -> list[Any]:
        return [
            {k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e
            for e in events(body)
        ]

    assert same(bodies[True]) == same(bodies[False])
    assert texts(events(bodies[True])) == [f"t{i} " for i in range(40)]
    assert events(bodies[True])[-1] == "[DONE]"
    # Every event but [DONE] carries its cursor, in order, whoever wrote it.
    cursors = re.findall(r"^id: (\d+)/(\d+)$", bodies[True], re.M)
    assert len(cursors) == len(events(bodies[True])) - 1
    order = [tuple(map(int, c)) for c in cursors]
    assert order == sorted(order) and len(set(order)) == len(order)
    # The request thread wrote ~every delta itself without the pump, few with it.
    assert writes[False] >= 40
    assert writes[True] <= 10, f"the request thread wrote {writes[True]} times"


def test_a_client_that_does_not_read_gets_every_event_once_in_order(
    pump_app: Flask,
    ids: RequestIds,
    script_with: Callable[..., Callable[[str], None]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The socket fills: the pump keeps what it could not write, stops, and the request
    thread writes the rest (and everything after it) as it writes any response."""
    leftovers: list[int] = []
    settle = SsePump.settle

    def spy(self: SsePump) -> None:
        if self.leftover:
            leftovers.append(len(self.leftover))
        settle(self)

    monkeypatch.setattr(SsePump, "settle", spy)
    piece = "y" * 2000  # ~2 KB per event against a few KB of socket buffer

    def slow_client(sock: socket.socket) -> str:
        time.sleep(1.5)  # everything is written meanwhile; the buffers are full
        return read_body(sock)

    body, _ = run_stream(
        pump_app, script_with(60, 0.005, piece), ids.peek(), client=slow_client, sndbuf=4096
    )
    evs = events(body)
    assert texts(evs) == [f"{piece}{i} " for i in range(60)]
    assert evs[-1] == "[DONE]"
    assert leftovers, "the socket never filled: the test proves nothing"


def test_a_client_that_hangs_up_ends_the_stream_at_once(
    pump_app: Flask,
    ids: RequestIds,
    script_with: Callable[..., Callable[[str], None]],
) -> None:
    rid = ids.peek()
    ended = threading.Event()

    def hang_up(sock: socket.socket) -> str:
        sock.settimeout(10)
        seen = b""
        while seen.count(b"data: ") < 5:
            seen += sock.recv(65536)
        sock.shutdown(socket.SHUT_RDWR)
        ended.set()
        return ""

    hung_up_at: list[float] = []

    def hang_up_and_note(sock: socket.socket) -> str:
        out = hang_up(sock)
        hung_up_at.append(time.monotonic())
        return out

    _, resp = run_stream(pump_app, script_with(400, 0.01), rid, client=hang_up_and_note)
    assert ended.is_set()
    # The script goes on for ~4 s; the request thread ended with the client, not it.
    lasted = resp.finished_at - hung_up_at[0]
    assert lasted < 2.0, f"the stream outlived its client by {lasted:.1f}s"
    assert resp.writes <= 1  # nothing but what the pump could not write


def test_a_pump_that_fails_ends_the_stream_with_an_error_event(
    pump_app: Flask,
    ids: RequestIds,
    script_with: Callable[..., Callable[[str], None]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    feed_json = ChunkStream.feed_json
    on_hub: list[bool] = []

    def breaks(self: ChunkStream, ev: OutputEvent) -> list[str]:
        if ev.text == "t20 ":
            on_hub.append(threading.current_thread().name == "output-hub")
            raise RuntimeError("framing broke")
        return feed_json(self, ev)

    monkeypatch.setattr(ChunkStream, "feed_json", breaks)
    body, _ = run_stream(pump_app, script_with(40, 0.01), ids.peek())
    evs = events(body)
    assert on_hub == [True], "the failing event was not framed by the pump"
    assert texts(evs) == [f"t{i} " for i in range(20)]
    error = evs[-2]
    assert isinstance(error, dict) and error["error"]["type"] == "internal_error"
    assert evs[-1] == "[DONE]"


def test_keep_alives_only_when_nothing_flows(
    settings: Settings,
    service: Runner,
    ids: RequestIds,
    scripted: ScriptedOutput,
) -> None:
    """Keep-alive 0.4 s: a stream that flows for 1 s (its request thread's wait ends
    twice meanwhile, with nothing for it) gets none; a pause of 1.2 s gets some."""
    app = create_app(settings.model_copy(update={"sse_keepalive_s": 0.4}), runner=service)

    def script(rid: str) -> None:
        time.sleep(0.1)
        for i in range(50):
            scripted.write(rid, delta(0, f"a{i} "))
            time.sleep(0.02)
        time.sleep(1.2)
        for i in range(5):
            scripted.write(rid, delta(0, f"b{i} "))
        scripted.write(rid, final(0), usage())

    body, _ = run_stream(app, script, ids.peek())
    evs = events(body)

    def at(text: str) -> int:  # by the delta's text: the response id is hex and may hold "b0"
        return next(i for i, e in enumerate(evs) if isinstance(e, dict) and texts([e]) == [text])

    first_b, last_a = at("b0 "), at("a49 ")
    assert "keep-alive" not in evs[:last_a]
    assert "keep-alive" in evs[last_a:first_b]
    assert texts(evs) == [f"a{i} " for i in range(50)] + [f"b{i} " for i in range(5)]


# -- the subscription's side ----------------------------------------------------------


def subscription() -> Subscription:
    return Subscription("r", "k", 0, queue.SimpleQueue())


def ev(text: str) -> list[OutputEvent]:
    return [OutputEvent(OutputKind.DELTA, 0, text)]


def test_a_pump_never_overtakes_queued_entries() -> None:
    sub = subscription()
    sub.put("1-0", ev("a"), 1)
    assert not sub.start_pump(lambda eid, events: Pumped.TAKEN)
    assert sub.take(None) == ("1-0", ev("a"))
    taken: list[str] = []
    assert sub.start_pump(lambda eid, events: taken.append(eid) or Pumped.TAKEN)  # type: ignore[func-returns-value]
    sub.put("2-0", ev("b"), 1)
    assert taken == ["2-0"] and sub.entries.empty() and sub.buffered == 0


def test_a_chunk_handed_as_read_is_decoded_where_it_is_taken() -> None:
    """The hub hands a chunk's bytes (``Subscription.put``): a pump gets its events, a
    queued one is decoded by ``take`` on the reader's thread, a malformed one ends its
    stream there (``MALFORMED_OUTPUT``), and the buffered count is the bytes'."""
    sub = subscription()
    both = [*ev("a"), OutputEvent(OutputKind.DELTA, 1, "b")]
    raw = encode_events(both)
    sub.put("1", raw, len(raw))
    assert sub.buffered == len(raw) and not sub.entries.empty()
    assert sub.take(None) == ("1", both) and sub.buffered == 0
    sub.put("2", b"[{nope", 6)
    assert sub.take(None) == ("2", [MALFORMED_OUTPUT])
    pumped: list[tuple[str, list[OutputEvent]]] = []
    assert sub.start_pump(lambda eid, events: pumped.append((eid, events)) or Pumped.TAKEN)  # type: ignore[func-returns-value]
    sub.put("3", encode_events(ev("c")), 9)
    assert pumped == [("3", ev("c"))]


def test_a_declined_entry_and_every_later_one_reach_the_queue_in_order() -> None:
    sub = subscription()
    verdicts = iter([Pumped.TAKEN, Pumped.DECLINED])
    assert sub.start_pump(lambda eid, events: next(verdicts))
    for i in range(1, 5):
        sub.put(f"{i}-0", ev(str(i)), 1)
    assert sub.pump is None
    assert [sub.take(None)[0] for _ in range(3)] == ["2-0", "3-0", "4-0"]


def test_a_pump_that_takes_its_last_entry_wakes_the_reader() -> None:
    sub = subscription()
    assert sub.start_pump(lambda eid, events: Pumped.TAKEN_LAST)
    threading.Timer(0.1, sub.put, args=("1-0", ev("a"), 1)).start()
    started = time.monotonic()
    with pytest.raises(queue.Empty):
        sub.take(10.0)
    assert time.monotonic() - started < 5  # woken, not timed out
    assert sub.pump is None and sub.entries.empty()


def test_stop_pump_waits_for_a_running_pump() -> None:
    sub = subscription()
    inside, release = threading.Event(), threading.Event()

    def slow(eid: str, events: list[OutputEvent]) -> Pumped:
        inside.set()
        release.wait(5)
        return Pumped.TAKEN

    assert sub.start_pump(slow)
    hub = threading.Thread(target=sub.put, args=("1-0", ev("a"), 1))
    hub.start()
    assert inside.wait(5)
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (sub.stop_pump(), stopped.set()))
    stopper.start()
    time.sleep(0.2)
    assert not stopped.is_set(), "stop_pump returned while the pump was still running"
    release.set()
    assert stopped.wait(5)
    hub.join(5)
    stopper.join(5)
    sub.put("2-0", ev("b"), 1)  # after the stop: queued
    assert sub.take(None)[0] == "2-0"
