"""The WebSocket chat (``/v1/ws``) with a real client (websocket-client) against a real
stack: redis-server, a Celery worker (echo engine), a streamer and the web server, each
its own process."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import websocket

from app.model_card import load_model_card, load_tokenizer
from broker.keys import Keys
from broker.requests import RequestStore
from tests.e2e.stop_cases import CASES, chat_body, expected
from tests.stack import Stack, full_stack, isolated_settings, wait_for, web_process, web_settings

pytestmark = pytest.mark.e2e

RATE = 40.0  # echo tokens per second per choice: slow enough to cancel mid-stream
LONG = " ".join(f"word{i}" for i in range(160))  # ~320 tokens: 8 s at RATE

# -- a client that sorts what it receives by request id ------------------------------------


@dataclass
class Reply:
    """Everything one request id received, in order."""

    deltas: list[dict[str, Any]] = field(default_factory=list)
    finals: dict[int, dict[str, Any]] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    done_at: float | None = None

    def text(self, choice: int = 0) -> str:
        return "".join(d["text"] for d in self.deltas if d["choice"] == choice)


class ChatClient:
    """A websocket-client connection that sorts incoming messages by request id."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.ws = websocket.create_connection(url, timeout=15, **kwargs)
        self.replies: dict[str, Reply] = {}
        self.untagged: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any] | str) -> None:
        self.ws.send(message if isinstance(message, str) else json.dumps(message))

    def chat(self, id: str, content: str, **body: Any) -> None:
        self.send(
            {"type": "chat", "id": id, "messages": [{"role": "user", "content": content}]} | body
        )

    def receive(self) -> dict[str, Any]:
        msg: dict[str, Any] = json.loads(self.ws.recv())
        rid = msg.get("id")
        if rid is None or msg["type"] == "pong":
            self.untagged.append(msg)
            return msg
        reply = self.replies.setdefault(rid, Reply())
        kind = msg["type"]
        if kind == "delta":
            assert not reply.done and msg["choice"] not in reply.finals, msg
            reply.deltas.append(msg)
        elif kind == "final":
            assert msg["choice"] not in reply.finals, msg
            reply.finals[msg["choice"]] = msg
        elif kind == "usage":
            reply.usage = msg["usage"]
        elif kind == "error":
            reply.errors.append(msg)
        elif kind == "done":
            assert not reply.done, f"two done messages for {rid}"
            reply.done, reply.done_at = True, time.monotonic()
        return msg

    def until(self, cond: Any, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out waiting on the socket"
            self.receive()

    def wait_done(self, *ids: str, timeout: float = 30) -> None:
        self.until(lambda: all(self.reply(i).done for i in ids), timeout)

    def reply(self, id: str) -> Reply:
        return self.replies.setdefault(id, Reply())

    def close(self) -> None:
        hang_up(self.ws)


def hang_up(ws: websocket.WebSocket) -> None:
    """Close and release the socket (``close`` alone keeps it once the server closed)."""
    ws.close()
    ws.shutdown()


# -- stacks -------------------------------------------------------------------------------


RESUME_GRACE_S = 1.0


def ws_url(stack: Stack) -> str:
    return stack.base_url.replace("http://", "ws://", 1) + "/v1/ws"


@pytest.fixture(scope="module")
def slow(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """This module's own stack: the echo engine at RATE (so requests can be cancelled
    mid-stream; the shared slow stack admits one request, these tests need two) and a
    small message limit (so an oversized message is cheap to send)."""
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=RATE,
        ws_max_message_bytes=4096,
        web_workers=1,
        web_threads=16,
        resume_grace_s=RESUME_GRACE_S,
    )
    with full_stack(settings, tmp_path_factory.mktemp("ws-logs")) as running:
        yield running


@pytest.fixture
def client(slow: Stack) -> Iterator[ChatClient]:
    """A connection to the slow stack."""
    c = ChatClient(ws_url(slow))
    yield c
    c.close()


@pytest.fixture
def fast_client(stack: Stack) -> Iterator[ChatClient]:
    """A connection to the shared stack (echo engine at full speed)."""
    c = ChatClient(ws_url(stack))
    yield c
    c.close()


# -- the tests ----------------------------------------------------------------------------


def test_two_concurrent_requests_and_a_cancel(client: ChatClient) -> None:
    client.chat("a", LONG)
    client.chat("b", LONG)
    # Both stream at once: each has output before either is anywhere near done.
    client.until(lambda: len(client.reply("a").deltas) >= 5 and len(client.reply("b").deltas) >= 5)
    a, b = client.reply("a"), client.reply("b")
    assert len(a.deltas) < 40 and len(b.deltas) < 40

    client.send({"type": "cancel", "id": "a"})
    seen_at_cancel = len(a.deltas)  # ASCII words: one token per delta at this rate
    cancelled_at = time.monotonic()
    client.wait_done("a")
    assert a.finals[0]["finish_reason"] == "abort"
    assert a.usage is not None and a.done_at is not None
    assert a.done_at - cancelled_at < 2.0
    # The worker stopped: at most half a second's worth of tokens after the cancel
    # (those already on their way through the streamer included).
    after = a.usage["completion_tokens"] - seen_at_cancel
    assert after <= RATE / 2, f"{after} tokens generated after the cancel"
    assert LONG.startswith(a.text()) and len(a.text()) < len(LONG)
    assert not b.done, "the other request must keep running"

    client.wait_done("b")
    assert b.text() == LONG
    assert b.finals[0]["finish_reason"] == "stop"
    assert b.usage is not None and set(b.usage) <= {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    assert b.errors == []


def test_closing_the_socket_cancels_generation(slow: Stack) -> None:
    settings, url = slow.settings, ws_url(slow)
    r = slow.redis()
    keys = Keys(settings.key_prefix)
    store = RequestStore(r, keys)
    before = {m.decode() for m in r.zrange(keys.inflight, 0, -1)}
    c = ChatClient(url)
    c.chat("x", LONG)
    c.until(lambda: len(c.reply("x").deltas) >= 3)
    (rid,) = {m.decode() for m in r.zrange(keys.inflight, 0, -1)} - before

    def published() -> int:
        return sum(len(p.token_ids) for p in store.progress(rid, 1))

    c.close()
    # Generation goes on for the resume grace (the client may come back), then stops.
    wait_for(lambda: store.is_cancelled(rid), RESUME_GRACE_S + 2, "the close to cancel the request")
    at_cancel = published()
    time.sleep(1.0)
    after = published() - at_cancel
    assert after <= RATE / 2, f"{after} tokens published after the request was cancelled"
    assert published() < 100
    wait_for(lambda: r.zscore(keys.inflight, rid) is None, 5, "the admission slot to be freed")


def test_bad_messages_get_errors_and_the_socket_stays_usable(client: ChatClient) -> None:
    client.send("{not json")
    msg = client.receive()
    assert msg["type"] == "error" and "id" not in msg
    assert msg["error"]["type"] == "invalid_request_error"
    assert msg["error"]["code"] == "invalid_json"

    client.send("[1, 2]")
    assert client.receive()["error"]["message"] == "Message must be a JSON object."

    client.send({"type": "launch", "id": "u"})
    msg = client.receive()
    assert msg["id"] == "u" and msg["error"]["param"] == "type"

    client.send({"type": "chat", "messages": [{"role": "user", "content": "hi"}]})
    msg = client.receive()
    assert msg["error"]["param"] == "id" and "id" not in msg

    client.chat("t", "hi", temperature=5)
    client.wait_done("t")
    (err,) = client.reply("t").errors
    assert err["error"]["param"] == "temperature"
    assert err["error"]["type"] == "invalid_request_error"
    assert client.reply("t").deltas == []

    client.chat("f", "hi", frobnicate=1)
    client.wait_done("f")
    assert client.reply("f").errors[0]["error"]["param"] == "frobnicate"

    client.chat("m", "hi", model="no-such-model")
    client.wait_done("m")
    assert client.reply("m").errors[0]["error"]["type"] == "not_found_error"

    # Over ws_max_message_bytes (4096 here): an error, not a closed socket.
    client.chat("big", "x" * 8000)
    client.wait_done("big")
    assert client.reply("big").errors[0]["error"]["code"] == "payload_too_large"
    client.send("[" * 5000)  # too large and not JSON either: still just an error
    msg = client.receive()
    assert msg["type"] == "error" and msg["error"]["code"] == "payload_too_large"

    # A duplicate id while the first is running: an error for it, the first unharmed.
    client.chat("d", LONG)
    client.until(lambda: len(client.reply("d").deltas) >= 1)
    client.chat("d", "again")
    client.until(lambda: len(client.reply("d").errors) == 1)
    assert client.reply("d").errors[0]["error"]["code"] == "duplicate_id"
    client.send({"type": "cancel", "id": "d"})
    client.wait_done("d")
    assert client.reply("d").finals[0]["finish_reason"] == "abort"

    client.send({"type": "ping", "id": "p1"})
    client.until(lambda: {"type": "pong", "id": "p1"} in client.untagged)

    # Cancelling what is not running is not an error (a cancel may race the end).
    client.send({"type": "cancel", "id": "nothing"})
    client.chat("ok", "hello there")
    client.wait_done("ok")
    assert client.reply("ok").text() == "hello there"
    assert client.reply("ok").errors == []
    assert "nothing" not in client.replies


def test_ids_may_be_reused_after_done(fast_client: ChatClient) -> None:
    client = fast_client
    for _ in range(2):
        client.chat("same", "short one")
        client.wait_done("same")
        assert client.reply("same").text() == "short one"
        del client.replies["same"]


def test_n_and_logprobs(fast_client: ChatClient) -> None:
    client = fast_client
    client.chat("n", "two choices", n=2, logprobs=True, top_logprobs=2)
    client.wait_done("n")
    reply = client.reply("n")
    assert reply.text(0) == reply.text(1) == "two choices"
    assert set(reply.finals) == {0, 1}
    entries = [e for d in reply.deltas if d["choice"] == 0 for e in d["logprobs"]["content"]]
    # One entry per generated token (the EOS that ended the choice included, as vLLM does).
    assert "".join(e["token"] for e in entries).startswith("two choices")
    assert all(len(e["top_logprobs"]) == 2 for e in entries)


def test_websocket_requests_are_in_the_metrics(slow: Stack, client: ChatClient) -> None:
    import requests

    client.chat("m1", "counted")
    client.chat("m2", "bad", temperature=9)
    client.wait_done("m1", "m2")
    text = requests.get(f"{slow.base_url}/metrics", timeout=10).text
    model = slow.settings.served_name
    labels = f'endpoint="/v1/ws",error_type="",mode="stream",model="{model}",status="200"'
    bad = (
        f'endpoint="/v1/ws",error_type="invalid_request_error",mode="stream",'
        f'model="{model}",status="400"'
    )
    assert "tokenrelay_generations_total{" + labels + "}" in text
    assert "tokenrelay_generations_total{" + bad + "}" in text
    ttft = "tokenrelay_time_to_first_token_seconds_count"
    assert f'{ttft}{{endpoint="/v1/ws",mode="stream",model="{model}"}}' in text


# -- stop handling: the same text as SSE and non-streaming (tests/e2e/stop_cases.py) -----


@pytest.mark.parametrize("case", sorted(CASES))
def test_stop_cases_same_text_over_websocket(
    case: str, fast_client: ChatClient, stack: Stack, model_dir: Path
) -> None:
    model = stack.settings.served_name
    body = chat_body(case, model, load_tokenizer(load_model_card(model_dir)))
    want = expected(case, model_dir, model)
    fast_client.send({"type": "chat", "id": case, **body})
    fast_client.wait_done(case)
    reply = fast_client.reply(case)
    assert reply.errors == []
    got = {
        c: (reply.text(c), final["finish_reason"], final["stop_reason"])
        for c, final in reply.finals.items()
    }
    assert got == {
        c: (want.texts[c], want.finish_reasons[c], want.stop_reasons[c]) for c in want.texts
    }
    assert reply.usage is not None
    assert reply.usage["completion_tokens"] == want.completion_tokens


# -- authentication and server pings ------------------------------------------------------

KEY = "sk-ws-test"


@pytest.fixture(scope="module")
def locked_url(slow: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another web process on the slow stack, with an API key and fast pings."""
    locked = web_settings(slow.settings, api_keys=[KEY], ws_ping_interval_s=0.3)
    with web_process(locked, tmp_path_factory.mktemp("ws-locked")):
        yield f"ws://{locked.host}:{locked.port}/v1/ws"


@pytest.mark.parametrize(
    ("query", "header"), [("", None), ("?api_key=wrong", None), ("", "Bearer wrong")]
)
def test_a_missing_or_wrong_key_is_refused(locked_url: str, query: str, header: str | None) -> None:
    ws = websocket.create_connection(
        locked_url + query, timeout=10, header=[f"Authorization: {header}"] if header else None
    )
    try:
        msg = json.loads(ws.recv())
        assert msg["type"] == "error"
        assert msg["error"]["type"] == "authentication_error"
        opcode, frame = ws.recv_data_frame(control_frame=True)
        assert opcode == websocket.ABNF.OPCODE_CLOSE
        assert int.from_bytes(frame.data[:2], "big") == 1008
    finally:
        hang_up(ws)


@pytest.mark.parametrize("how", ["bearer", "query"])
def test_a_good_key_is_accepted(locked_url: str, how: str) -> None:
    if how == "bearer":
        c = ChatClient(locked_url, header=[f"Authorization: Bearer {KEY}"])
    else:
        c = ChatClient(f"{locked_url}?api_key={KEY}")
    try:
        c.chat("k", "with a key")
        c.wait_done("k")
        assert c.reply("k").text() == "with a key"
    finally:
        c.close()


def test_the_server_pings(locked_url: str) -> None:
    ws = websocket.create_connection(locked_url, timeout=5, header=[f"Authorization: Bearer {KEY}"])
    try:
        # websocket-client answers each ping with a pong while it reads, so the server
        # keeps the connection through several rounds.
        pings = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            opcode, _ = ws.recv_data_frame(control_frame=True)
            assert opcode == websocket.ABNF.OPCODE_PING
            pings += 1
        assert pings >= 3
        ws.send(json.dumps({"type": "ping"}))
        while True:
            opcode, frame = ws.recv_data_frame(control_frame=True)
            if opcode == websocket.ABNF.OPCODE_TEXT:
                assert json.loads(frame.data) == {"type": "pong"}
                break
    finally:
        hang_up(ws)


def test_a_client_that_misses_pongs_is_dropped(locked_url: str) -> None:
    ws = websocket.create_connection(locked_url, timeout=5, header=[f"Authorization: Bearer {KEY}"])
    try:
        time.sleep(1.5)  # not reading: the pings go unanswered
        with pytest.raises((websocket.WebSocketConnectionClosedException, OSError)):
            while True:
                opcode, _ = ws.recv_data_frame(control_frame=True)
                if opcode == websocket.ABNF.OPCODE_CLOSE:
                    raise websocket.WebSocketConnectionClosedException("closed")
    finally:
        hang_up(ws)


# -- the protocol's pure half (no socket) -------------------------------------------------


def _parse(raw: str | bytes, max_bytes: int = 4096) -> Any:
    from web.ws_messages import parse_client_message

    return parse_client_message(raw, max_bytes=max_bytes)


def test_parse_client_messages() -> None:
    """The envelope only: chat bodies are validated by Runner.start like HTTP bodies
    (their errors are covered by the socket tests above)."""
    from web.ws_messages import CancelChat, ChatStart, Ping, RejectedMessage, ResumeChat

    chat = _parse('{"type":"chat","id":"q","messages":[{"role":"user","content":"a\tb"}]}')
    assert isinstance(chat, ChatStart) and chat.id == "q"
    assert chat.body == {"messages": [{"role": "user", "content": "a\tb"}]}
    body = {"type": "chat", "id": "o", "messages": [{"role": "user", "content": "x"}]}
    assert _parse('{"type":"cancel","id":"q"}') == CancelChat("q")
    assert _parse(b'{"type":"ping"}') == Ping(None)
    resume = {"type": "resume", "id": "r", "request_id": "abc", "cursor": "17/2"}
    assert _parse(json.dumps(resume)) == ResumeChat("r", "abc", "17/2")
    assert _parse(json.dumps(resume | {"cursor": None})) == ResumeChat("r", "abc", None)

    def rejected(raw: str | bytes, max_bytes: int = 4096) -> RejectedMessage:
        with pytest.raises(RejectedMessage) as info:
            _parse(raw, max_bytes)
        return info.value

    assert rejected("nope").error.code == "invalid_json"
    assert rejected(json.dumps(body | {"id": ""})).error.param == "id"
    assert rejected(json.dumps(body | {"id": "x" * 257})).id is None
    unknown = rejected('{"type":"nudge","id":"k"}')
    assert (unknown.id, unknown.final) == ("k", False)
    big = rejected(json.dumps(body | {"user": "é" * 3000}), max_bytes=4096)
    assert (big.error.status, big.id, big.final) == (413, "o", True)
    assert rejected(json.dumps(resume | {"cursor": "bogus"})).error.param == "cursor"
    assert rejected(json.dumps(resume | {"request_id": 5})).error.param == "request_id"


def test_server_messages_from_output_events() -> None:
    from app.messages import FinishReason, LogprobEntry, OutputEvent, OutputKind
    from web.ws_messages import server_message

    delta = OutputEvent(
        OutputKind.DELTA, 1, "hi", logprobs=[LogprobEntry(5, "hi", -0.5, [104, 105])]
    )
    assert server_message("r", delta) == {
        "type": "delta",
        "id": "r",
        "choice": 1,
        "text": "hi",
        "logprobs": {
            "content": [{"token": "hi", "logprob": -0.5, "bytes": [104, 105], "top_logprobs": []}],
            "refusal": None,
        },
    }
    final = OutputEvent(OutputKind.FINAL, 0, finish_reason=FinishReason.STOP, stop_reason="\n")
    assert server_message("r", final) == {
        "type": "final",
        "id": "r",
        "choice": 0,
        "finish_reason": "stop",
        "stop_reason": "\n",
    }
    usage = OutputEvent(
        OutputKind.USAGE,
        usage={
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "timings": {"queue_s": 0.1},
            "streamer": "s1",
        },
    )
    assert server_message("r", usage)["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
    }
    error = server_message("r", OutputEvent(OutputKind.ERROR, error="too slow", code=504))
    assert error == {
        "type": "error",
        "id": "r",
        "error": {"message": "too slow", "type": "timeout_error", "param": None, "code": None},
    }
