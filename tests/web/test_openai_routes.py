"""The OpenAI routes with Flask's test client, a real Runner on a real
redis-server, and output streams written by the test (no worker, no streamer)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from app.messages import FinishReason, LogprobEntry
from app.records import RequestRecord
from app.settings import Settings
from broker.keys import Keys
from broker.requests import RequestStore
from broker.run import Run
from broker.runner import Runner
from tests.web.conftest import RequestIds, ScriptedOutput, delta, error, final, usage
from web.bodies import loads_repaired

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def chat(content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **kw}


def sse_payloads(body: str) -> list[Any]:
    """The data payloads of an SSE body, checking the framing on the way."""
    assert body.endswith("data: [DONE]\n\n")
    out: list[Any] = []
    for block in body.split("\n\n")[:-1]:
        if block.startswith(":"):
            continue
        if block.startswith("id: "):  # the resume cursor (docs/api.md)
            event_id, _, block = block.partition("\n")
            assert re.fullmatch(r"id: \d+/\d+", event_id), event_id
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


def error_of(resp: Any) -> dict[str, Any]:
    body = resp.get_json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    err: dict[str, Any] = body["error"]
    return err


# -- success paths --------------------------------------------------------------------------


def test_non_streaming_chat_folds_the_output(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    rid = ids.peek()
    scripted.write(rid, delta(0, "Hel"), delta(0, "lo"), final(0, stop="\n"), usage(5, 2))
    resp = client.post(CHAT, json=chat())
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == rid
    body = resp.get_json()
    assert body["id"] == f"chatcmpl-{rid}" and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": "\n",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert scripted.in_flight() == []  # the admission slot was given back


def test_stream_framing_roles_deltas_finals_usage_done(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    rid = ids.peek()
    scripted.write(
        rid,
        delta(1, "b"),
        delta(0, "a"),
        final(0, stop="x"),
        delta(1, "c"),
        final(1, FinishReason.LENGTH),
        usage(3, 4),
    )
    resp = client.post(CHAT, json=chat(n=2, stream=True, stream_options={"include_usage": True}))
    assert resp.status_code == 200
    assert resp.mimetype == "text/event-stream"
    assert resp.headers["x-request-id"] == rid
    chunks = sse_payloads(resp.get_data(as_text=True))
    resp.close()
    assert {c["id"] for c in chunks} == {f"chatcmpl-{rid}"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    roles = [c["choices"][0] for c in chunks[:2]]
    assert roles == [
        {
            "index": i,
            "delta": {"role": "assistant", "content": "", "refusal": None},
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
        for i in range(2)
    ]
    middle = [c["choices"][0] for c in chunks[2:-1]]
    got = [(ch["index"], ch["delta"], ch["finish_reason"], ch["stop_reason"]) for ch in middle]
    assert got == [
        (1, {"content": "b"}, None, None),
        (0, {"content": "a"}, None, None),
        (0, {}, "stop", "x"),
        (1, {"content": "c"}, None, None),
        (1, {}, "length", None),
    ]
    assert chunks[-1]["choices"] == []
    # The streamer's internal keys never reach a client.
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert "usage" not in chunks[0]
    assert scripted.in_flight() == []


def test_stream_without_include_usage_sends_no_usage_chunk(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    scripted.write(ids.peek(), delta(0, "a"), final(0), usage())
    resp = client.post(CHAT, json=chat(stream=True))
    chunks = sse_payloads(resp.get_data(as_text=True))
    resp.close()
    assert all(c["choices"] for c in chunks)


def _entry(token_id: int, text: str) -> LogprobEntry:
    return LogprobEntry(token_id, text, -0.5, list(text.encode()), [(text, -0.5), ("z", -2.0)])


def test_completions_stream_list_of_prompts_and_logprobs(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    rid = ids.peek()
    scripted.write(
        rid,
        delta(0, "ab", logprobs=[_entry(1, "a"), _entry(2, "b")]),
        delta(0, "c", logprobs=[_entry(3, "c")]),
        final(0),
        delta(1, "x", logprobs=[_entry(4, "x")]),
        final(1),
        usage(),
    )
    resp = client.post(
        "/v1/completions", json={"prompt": ["one", "two"], "logprobs": 1, "stream": True}
    )
    chunks = sse_payloads(resp.get_data(as_text=True))
    resp.close()
    assert {c["object"] for c in chunks} == {"text_completion"}
    first, second = chunks[0]["choices"][0], chunks[1]["choices"][0]
    assert first["text"] == "ab" and first["logprobs"]["tokens"] == ["a", "b"]
    assert first["logprobs"]["text_offset"] == [0, 1]
    assert second["logprobs"]["text_offset"] == [2]  # continues where the last chunk ended
    assert first["logprobs"]["top_logprobs"][0] == {"a": -0.5, "z": -2.0}
    assert [c["choices"][0]["index"] for c in chunks] == [0, 0, 0, 1, 1]


def test_chat_logprobs_streamed_and_folded(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    events = (delta(0, "a", logprobs=[_entry(1, "a")]), final(0), usage())
    scripted.write(ids.peek(), *events)
    body = client.post(CHAT, json=chat(logprobs=True, top_logprobs=1)).get_json()
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "a" and content[0]["logprob"] == -0.5
    assert content[0]["top_logprobs"][1] == {"token": "z", "logprob": -2.0, "bytes": [122]}
    scripted.write(ids.peek(), *events)
    resp = client.post(CHAT, json=chat(logprobs=True, top_logprobs=1, stream=True))
    chunks = sse_payloads(resp.get_data(as_text=True))
    resp.close()
    assert chunks[1]["choices"][0]["logprobs"]["content"] == content


def test_keep_alive_comments_while_waiting(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    """The output is written once the stream has sent a keep-alive, not at a fixed time:
    on a loaded machine the request's start alone can outlast a fixed delay (the output
    then arrives before any keep-alive is due). If none ever comes, a fallback writes
    the output after 10 s so the stream ends and the test fails instead of hanging."""
    rid = ids.peek()
    lock = threading.Lock()
    written: list[bool] = []

    def write_once() -> None:
        with lock:
            if not written:
                written.append(True)
                scripted.write(rid, delta(0, "late"), final(0), usage())

    fallback = threading.Timer(10.0, write_once)
    fallback.start()
    resp = client.post(CHAT, json=chat(stream=True))
    pieces: list[str] = []
    for piece in resp.response:
        pieces.append(piece.decode() if isinstance(piece, bytes) else piece)
        if ": keep-alive\n\n" in pieces[-1]:
            write_once()
    resp.close()
    fallback.cancel()
    body = "".join(pieces)
    assert ": keep-alive\n\n" in body
    assert body.index(": keep-alive\n\n") < body.index("late")
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in sse_payloads(body)) == "late"
    )


def test_client_request_id_is_echoed(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    scripted.write(ids.peek(), delta(0, "a"), final(0), usage())
    resp = client.post(CHAT, json=chat(), headers={"X-Request-Id": "client-123"})
    assert resp.headers["x-request-id"] == "client-123"
    bad = client.get("/health", headers={"X-Request-Id": "bad id\twith spaces"})
    assert bad.headers["x-request-id"] != "bad id\twith spaces"
    assert client.get("/nope").headers["x-request-id"]


# -- errors from the pipeline -----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("event", "status", "kind"),
    [
        (error("prompt too long for the cache", 400, choice=0), 400, "invalid_request_error"),
        (error("No live worker serves the model.", 503), 503, "service_unavailable_error"),
        (error("The request passed its deadline.", 504), 504, "timeout_error"),
    ],
)
@pytest.mark.parametrize(
    ("route", "body"),
    [(CHAT, chat()), ("/v1/responses", {"input": "hi"})],
    ids=["chat", "responses"],
)
def test_error_before_any_output_is_the_http_status(
    client: FlaskClient,
    ids: RequestIds,
    scripted: ScriptedOutput,
    event: Any,
    status: int,
    kind: str,
    stream: bool,
    route: str,
    body: dict[str, Any],
) -> None:
    """Every transport (one driver, ``broker.drive.opening``): a stream does not start
    with a 200 when the request failed before its first event."""
    rid = ids.peek()
    scripted.write(rid, event, error(event.error, event.code), usage())
    resp = client.post(route, json={**body, "stream": stream})
    assert resp.status_code == status
    err = error_of(resp)
    assert err["message"] == event.error and err["type"] == kind
    assert resp.headers["x-request-id"] == rid
    assert scripted.in_flight() == []


def test_error_after_output_is_an_sse_event_and_the_stream_ends(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    rid = ids.peek()
    scripted.write(rid, delta(0, "partial"), error("lost", 503, choice=0), error("lost", 503))
    resp = client.post(CHAT, json=chat(stream=True))
    assert resp.status_code == 200
    chunks = sse_payloads(resp.get_data(as_text=True))
    resp.close()
    assert chunks[-1] == {
        "error": {
            "message": "lost",
            "type": "service_unavailable_error",
            "param": None,
            "code": None,
        }
    }
    assert chunks[1]["choices"][0]["delta"] == {"content": "partial"}
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'tokenrelay_stream_errors_total{endpoint="/v1/chat/completions",' in metrics


def test_one_failed_choice_ends_that_choice_only(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    """n>1 as backend.rs: an error ends its choice (finish_reason "error" + its error);
    the others go on, in the JSON body and in the stream alike."""
    events = (
        delta(0, "fine"),
        delta(1, "x"),
        error("engine failed", 500, choice=1),
        delta(0, " still"),
        final(0),
        usage(),
    )
    rid = ids.peek()
    scripted.write(rid, *events)
    resp = client.post(CHAT, json=chat(n=2))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    choices = resp.get_json()["choices"]
    assert choices[0]["message"]["content"] == "fine still"
    assert choices[0]["finish_reason"] == "stop" and "error" not in choices[0]
    assert choices[1]["finish_reason"] == "error"
    assert choices[1]["error"]["message"] == "engine failed"
    assert choices[1]["error"]["type"] == "internal_error"

    rid = ids.peek()
    scripted.write(rid, *events)
    chunks = sse_payloads(client.post(CHAT, json=chat(n=2, stream=True)).get_data(as_text=True))
    finals = {
        c["choices"][0]["index"]: c["choices"][0]
        for c in chunks
        if c["choices"][0].get("finish_reason")
    }
    assert (
        finals[1]["finish_reason"] == "error" and finals[1]["error"]["message"] == "engine failed"
    )
    assert finals[0]["finish_reason"] == "stop"
    text0 = "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["choices"][0]["index"] == 0
    )
    assert text0 == "fine still"
    assert not any("error" in c and "choices" not in c for c in chunks)


def test_every_choice_failing_is_the_http_status(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    rid = ids.peek()
    scripted.write(
        rid, error("prompt too long", 400, choice=0), error("prompt too long", 400, choice=1)
    )
    for stream in (False, True):
        rid = ids.peek()
        scripted.write(
            rid,
            error("prompt too long", 400, choice=0),
            error("prompt too long", 400, choice=1),
            usage(),
        )
        resp = client.post(CHAT, json=chat(n=2, stream=stream))
        assert resp.status_code == 400
        assert error_of(resp)["message"] == "prompt too long"


def test_disconnect_cancels_and_frees_the_slot(
    make_client: Callable[..., tuple[FlaskClient, Runner]],
    ids: RequestIds,
    scripted: ScriptedOutput,
) -> None:
    """A lost stream's generation goes on for resume_grace_s (the client may resume
    it), then is cancelled since nobody follows it."""
    client, _ = make_client(resume_grace_s=0.5)
    rid = ids.peek()
    scripted.write(rid, delta(0, "first"))  # ... and nothing more: still generating
    resp = client.post(CHAT, json=chat(stream=True), buffered=False)
    stream = iter(resp.response)
    assert b"assistant" in next(stream)
    assert b"first" in next(stream)
    assert rid in scripted.in_flight() and not scripted.cancelled(rid)
    resp.close()  # what the WSGI server does when the client's socket is gone
    assert not scripted.cancelled(rid)  # not yet: the client may resume
    deadline = time.monotonic() + 5
    while not scripted.cancelled(rid):
        assert time.monotonic() < deadline, "the abandoned request was never cancelled"
        time.sleep(0.05)
    assert scripted.in_flight() == []
    metrics = client.get("/metrics").get_data(as_text=True)
    gone = 'tokenrelay_client_disconnects_total{endpoint="/v1/chat/completions",model="'
    assert re.search(re.escape(gone) + r'[^"]+"\} 1\.0', metrics), metrics
    labels = 'endpoint="/v1/chat/completions",mode="stream",model="'
    assert "tokenrelay_requests_cancelled_total{" + labels in metrics
    assert "tokenrelay_requests_in_flight{" + labels in metrics
    assert 'status="499"' in metrics


def test_resume_after_a_lost_connection_gets_exactly_the_rest(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    rid = ids.peek()
    scripted.write(rid, delta(0, "one "), delta(0, "two "))
    resp = client.post(CHAT, json=chat(stream=True), buffered=False)
    stream = iter(resp.response)
    next(stream)  # role
    seen = next(stream).decode() + next(stream).decode()
    assert "one " in seen and "two " in seen
    resp.close()  # the connection drops after "one two " was sent
    last_id = re.findall(r"^id: (\S+)$", seen, re.M)[-1]
    scripted.write(rid, delta(0, "three"), final(0), usage())
    again = client.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": last_id})
    assert again.status_code == 200
    chunks = sse_payloads(again.get_data(as_text=True))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "three"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # A finished request replays from the start, role chunk included.
    replay = sse_payloads(client.get(f"/v1/streams/{rid}").get_data(as_text=True))
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in replay if c["choices"])
        == "one two three"
    )
    assert client.get("/v1/streams/nope").status_code == 404
    bad = client.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": "garbage"})
    assert bad.status_code == 400


def test_a_resume_in_the_middle_of_an_entry_skips_exactly_what_was_seen(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    rid = ids.peek()
    scripted.write(rid, delta(0, "a"), delta(0, "b"), delta(0, "c"), final(0), usage())
    full = client.post(CHAT, json=chat(stream=True)).get_data(as_text=True)
    ids_seen = re.findall(r"^id: (\S+)$", full, re.M)
    after_a = ids_seen[0]  # the delta "a"
    chunks = sse_payloads(
        client.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": after_a}).get_data(as_text=True)
    )
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "bc"


def test_fail_fast_without_workers_or_streamers(
    client: FlaskClient, fleet: Any, scripted: ScriptedOutput
) -> None:
    fleet.stop_workers()
    started = time.monotonic()
    for stream in (False, True):
        resp = client.post(CHAT, json=chat(stream=stream))
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert "No live worker" in error_of(resp)["message"]
    assert time.monotonic() - started < 1.0
    assert scripted.in_flight() == []
    fleet.workers.heartbeat(fleet.worker)
    fleet.stop_streamers()
    time.sleep(1.1)  # past the positive readiness cache
    resp = client.post(CHAT, json=chat())
    assert resp.status_code == 503 and "No live streamer" in error_of(resp)["message"]
    metrics = client.get("/metrics").get_data(as_text=True)
    assert "tokenrelay_requests_rejected_total{" in metrics
    assert 'reason="service_unavailable_error"' in metrics


# -- request errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(temperature=3), "temperature"),
        (chat(bogus_field=1), "bogus_field"),
        (chat(n=99), "n"),
        (chat(stop=[f"s{i}" for i in range(40)]), "stop"),
        ({"messages": []}, "messages"),
        ({"model": "x"}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        ([1, 2], None),
    ],
)
def test_validation_errors_name_the_parameter(
    client: FlaskClient, body: Any, param: str | None
) -> None:
    resp = client.post(CHAT, json=body)
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_bad_json_is_400_without_the_parsers_message(client: FlaskClient) -> None:
    resp = client.post(CHAT, data=b'{"messages": [', content_type="application/json")
    assert resp.status_code == 400
    assert "not valid JSON" in error_of(resp)["message"]
    assert "Expecting" not in resp.get_data(as_text=True)


def test_raw_control_characters_and_bad_utf8_are_repaired(
    client: FlaskClient,
    ids: RequestIds,
    scripted: ScriptedOutput,
    settings: Settings,
    service: Runner,
) -> None:
    rid = ids.peek()
    scripted.write(rid, delta(0, "ok"), final(0), usage())
    raw = b'{"messages": [{"role": "user", "content": "tab\there\nline \xff\xfe end"}]}'
    resp = client.post(CHAT, data=raw, content_type="application/json")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    store = RequestStore(scripted.redis, Keys(settings.key_prefix))
    loaded = store.load(rid)
    assert loaded is not None
    record: RequestRecord = loaded[0]
    assert record.echo_ids is not None
    echoed = service.intake.builder.tokenizer.decode(record.echo_ids[0])
    assert echoed == "tab\there\nline \ufffd\ufffd end"


def test_lone_surrogates_are_replaced() -> None:
    assert loads_repaired(b'{"a": "x\\ud800y"}') == {"a": "x\ufffdy"}
    assert loads_repaired('{"a": "\\ud83d\\ude00"}') == {"a": "😀"}


def test_unknown_model_is_404(client: FlaskClient) -> None:
    resp = client.post(CHAT, json=chat(model="no-such-model"))
    assert resp.status_code == 404
    err = error_of(resp)
    assert err["param"] == "model" and err["code"] == "model_not_found"


def test_context_overflow_is_400_with_the_numbers(client: FlaskClient) -> None:
    resp = client.post(CHAT, json=chat(max_tokens=100_000))
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["code"] == "context_length_exceeded" and "8192" in err["message"]


def test_http_level_errors(client: FlaskClient) -> None:
    assert client.get("/v1/nothing").status_code == 404
    assert error_of(client.get("/v1/nothing"))["type"] == "not_found_error"
    resp = client.get(CHAT)
    assert resp.status_code == 405 and error_of(resp)["code"] == "method_not_allowed"
    resp = client.post(CHAT, data="hello", content_type="text/plain")
    assert resp.status_code == 415 and error_of(resp)["code"] == "unsupported_media_type"
    resp = client.post(CHAT, data=json.dumps(chat()))  # no content type at all
    assert resp.status_code == 415


def test_body_too_large_is_413(make_client: Callable[..., Any]) -> None:
    client, _svc = make_client(max_body_bytes=2048)
    resp = client.post(CHAT, json=chat("x" * 5000))
    assert resp.status_code == 413
    assert error_of(resp)["code"] == "payload_too_large"


def test_deprecated_functions_are_501(client: FlaskClient) -> None:
    resp = client.post(CHAT, json=chat(functions=[{"name": "f", "parameters": {}}]))
    assert resp.status_code == 501
    assert error_of(resp)["param"] == "functions"


def test_api_keys(make_client: Callable[..., Any], ids: RequestIds) -> None:
    client, _svc = make_client(api_keys=["k1", "k2"])
    resp = client.get("/v1/models")
    assert resp.status_code == 401 and error_of(resp)["type"] == "authentication_error"
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert client.post(CHAT, json=chat()).status_code == 401
    assert client.get("/health").status_code == 200  # probes and metrics stay open
    assert client.get("/metrics").status_code == 200


def test_queue_full_is_429_with_retry_after(
    make_client: Callable[..., Any], scripted: ScriptedOutput
) -> None:
    client, svc = make_client(max_queue=1)
    assert svc.store.admit("someone-else", time.time() + 60, 1, time.time())[0]
    try:
        resp = client.post(CHAT, json=chat())
        assert resp.status_code == 429
        assert resp.headers["Retry-After"] == "1"
        assert error_of(resp)["type"] == "rate_limit_error"
    finally:
        svc.store.release("someone-else")


# -- nothing leaks ----------------------------------------------------------------------------


def _boom(*_a: Any, **_k: Any) -> Any:
    raise RuntimeError("/secret/path/to/module.py: something broke")


def test_a_bug_is_a_generic_500(
    client: FlaskClient, service: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service.intake.builder, "chat", _boom)
    resp = client.post(CHAT, json=chat())
    assert resp.status_code == 500
    text = resp.get_data(as_text=True)
    assert "/secret" not in text and "RuntimeError" not in text and "Traceback" not in text
    assert error_of(resp)["type"] == "internal_error"


def test_a_bug_mid_stream_is_a_generic_error_event(
    client: FlaskClient,
    ids: RequestIds,
    scripted: ScriptedOutput,
    service: Runner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rid = ids.peek()
    scripted.write(rid, delta(0, "a"))
    real_next = Run.next
    calls = 0

    def first_then_boom(self: Run, timeout_s: float) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            _boom()
        return real_next(self, timeout_s)

    monkeypatch.setattr(Run, "next", first_then_boom)
    resp = client.post(CHAT, json=chat(stream=True))
    text = resp.get_data(as_text=True)
    resp.close()
    assert resp.status_code == 200
    assert "/secret" not in text and "RuntimeError" not in text
    assert sse_payloads(text)[-1]["error"]["type"] == "internal_error"
    assert scripted.cancelled(rid)


# -- models and health ------------------------------------------------------------------------


def test_models(make_client: Callable[..., Any], fleet: Any, bundled_model_dir: Path) -> None:
    client, _svc = make_client(served_model_name="org/model-x")
    fleet.serve("org/model-x", bundled_model_dir)
    listing = client.get("/v1/models").get_json()
    assert listing["object"] == "list"
    # Every model with a live worker (the fleet's own too), the process's default first.
    model, other = listing["data"]
    assert other["id"] == fleet.worker.model
    assert model["id"] == "org/model-x" and model["object"] == "model"
    assert model["max_model_len"] == 8192
    one = client.get("/v1/models/org/model-x")
    assert one.status_code == 200 and one.get_json() == model
    missing = client.get("/v1/models/org/other")
    assert missing.status_code == 404 and error_of(missing)["code"] == "model_not_found"


def test_health_and_ready(client: FlaskClient, app: Flask, fleet: Any) -> None:
    assert client.get("/health").get_json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    fleet.stop_workers()
    resp = client.get("/ready")
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert "No live worker" in error_of(resp)["message"]


def test_timings_as_llama_cpp_names_them(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    """llama.cpp's ``timings`` in the JSON body and in the streamed usage chunk;
    ``predicted_n`` is the completion's token count."""
    for stream in (False, True):
        rid = ids.peek()
        scripted.write(rid, delta(0, "ab"), final(0), usage(5, 2))
        body = chat(stream=stream, stream_options={"include_usage": True} if stream else None)
        resp = client.post(CHAT, json={k: v for k, v in body.items() if v is not None})
        last = sse_payloads(resp.get_data(as_text=True))[-1] if stream else resp.get_json()
        timings = last["timings"]
        assert timings["predicted_n"] == last["usage"]["completion_tokens"] == 2
        assert timings["prompt_n"] == 5
        for name in ("prompt_ms", "predicted_ms", "predicted_per_second", "queue_ms", "ttft_ms"):
            assert name in timings


def test_only_the_key_that_made_a_stream_may_resume_it(
    make_client: Callable[..., Any], ids: RequestIds, scripted: ScriptedOutput
) -> None:
    """Streams are tenants' like files and batches: another key is told the stream does
    not exist, and so is an admin key (its reach is files, batches and stored responses:
    issue 47, finding 10)."""
    client, _ = make_client(api_keys=["k-alpha", "k-beta", "k-admin"], admin_api_keys=["k-admin"])
    rid = ids.peek()
    scripted.write(rid, delta(0, "secret"), final(0), usage())
    alpha = {"Authorization": "Bearer k-alpha"}
    beta = {"Authorization": "Bearer k-beta"}
    admin = {"Authorization": "Bearer k-admin"}
    assert client.post(CHAT, json=chat(stream=True), headers=alpha).status_code == 200
    for headers in (beta, admin):
        other = client.get(f"/v1/streams/{rid}", headers=headers)
        assert other.status_code == 404 and error_of(other)["code"] == "stream_not_found"
    again = client.get(f"/v1/streams/{rid}", headers=alpha)
    assert again.status_code == 200 and "secret" in again.get_data(as_text=True)


def test_a_stream_writes_what_one_read_brings_in_one_piece(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    """Issue 12, item 4: the events already there when the stream reads are framed and
    written together (one write per read), not one write per event; the text and the
    frames are the same."""
    rid = ids.peek()
    for i in range(30):  # thirty output entries, all waiting before the client reads
        scripted.write(rid, delta(0, f"w{i} "))
    scripted.write(rid, final(0), usage(3, 30))
    resp = client.post(CHAT, json=chat(stream=True), buffered=False)
    pieces = [p.decode() if isinstance(p, bytes) else p for p in resp.response]
    resp.close()
    chunks = sse_payloads("".join(pieces))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(f"w{i} " for i in range(30))
    assert sum(p.count("data: ") for p in pieces) == len(chunks) + 1  # + [DONE]
    # The role chunk, everything that was waiting, [DONE]: a handful of writes, not 33.
    assert len(pieces) <= 4, [p[:40] for p in pieces]
