"""Pure batch pieces: validating input lines, result lines, folding output events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.batches import (
    BatchCreateRequest,
    BatchOutputLine,
    PlannedLine,
    RejectedLine,
    check_batch_request,
    failed_line,
    not_run_line,
    plan_batch,
    rejected_line,
    success_line,
)
from app.errors import InvalidRequest, NotFound, error_body
from app.fold import ResponseFold
from app.messages import FinishReason, OutputEvent, OutputKind
from app.protocol import parse_chat_request

CHAT = "/v1/chat/completions"


def build(body: dict[str, Any]) -> str:
    req = parse_chat_request(body)
    if req.model not in (None, "ours"):
        raise NotFound(f"The model '{req.model}' does not exist.", code="model_not_found")
    return req.messages[-1].text


def line(cid: Any = "a", url: str = CHAT, method: str = "POST", **body: Any) -> bytes:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body}).encode()


def plan(*lines: bytes, max_line_bytes: int = 10_000, max_requests: int = 100) -> Any:
    return plan_batch(
        b"\n".join(lines),
        endpoint=CHAT,
        build=build,
        max_line_bytes=max_line_bytes,
        max_requests=max_requests,
    )


def test_valid_lines_are_built_and_blank_lines_skipped() -> None:
    p = plan(line("a"), b"", line("b", messages=[{"role": "user", "content": "yo"}]), b"  ")
    assert not p.errors and p.total == 2
    assert p.lines == [PlannedLine(0, "a", "hi"), PlannedLine(2, "b", "yo")]


@pytest.mark.parametrize(
    ("raw", "custom_id", "param"),
    [
        (b"{not json", None, None),
        (b"[1, 2]", None, None),
        (line(cid=""), None, "custom_id"),
        (line(cid=7), None, "custom_id"),
        (line(method="GET"), "a", "method"),
        (line(url="/v1/completions"), "a", "url"),
        (line(temperature=9), "a", "temperature"),
        (line(stream=True), "a", "body.stream"),
        (line(model="other"), "a", None),
        (line(bogus=1), "a", "bogus"),
    ],
)
def test_a_bad_line_is_rejected_alone(raw: bytes, custom_id: str | None, param: str) -> None:
    p = plan(line("first"), raw, line("last"))
    assert not p.errors and p.total == 3
    bad = p.lines[1]
    assert isinstance(bad, RejectedLine) and bad.index == 1 and bad.custom_id == custom_id
    status, body = error_body(bad.error)
    assert 400 <= status < 500 and body["error"]["param"] == param
    assert isinstance(p.lines[0], PlannedLine) and isinstance(p.lines[2], PlannedLine)


def test_too_long_and_broken_lines() -> None:
    long = line("long", messages=[{"role": "user", "content": "x" * 500}])
    p = plan(long, max_line_bytes=200)
    assert isinstance(p.lines[0], RejectedLine)
    assert error_body(p.lines[0].error)[0] == 413
    # Broken UTF-8 and raw control characters are repaired, as for an HTTP body.
    repaired = b'{"custom_id":"r","method":"POST","url":"/v1/chat/completions",' + (
        b'"body":{"messages":[{"role":"user","content":"a\xff\tb"}]}}'
    )
    assert plan(repaired).lines == [PlannedLine(0, "r", "a\ufffd\tb")]


def test_a_bug_in_building_a_line_is_a_generic_500_line() -> None:
    def broken(_body: dict[str, Any]) -> str:
        raise RuntimeError("/secret/path")

    p = plan_batch(line(), endpoint=CHAT, build=broken, max_line_bytes=10**6, max_requests=9)
    assert isinstance(p.lines[0], RejectedLine)
    status, body = error_body(p.lines[0].error)
    assert status == 500 and "secret" not in json.dumps(body)


def test_file_level_problems_fail_the_batch() -> None:
    assert [e.code for e in plan(b"", b"  ").errors] == ["empty_file"]
    assert [e.code for e in plan(line("a"), line("b"), max_requests=1).errors] == [
        "too_many_requests"
    ]
    dup = plan(line("a"), line("b"), line("a"))
    assert [(e.code, e.line) for e in dup.errors] == [("duplicate_custom_id", 3)]


def test_batch_request_checks() -> None:
    ok = BatchCreateRequest(
        input_file_id="file-1", endpoint=CHAT, completion_window="24h", metadata={"k": "v"}
    )
    assert check_batch_request(ok) == {"k": "v"}
    for change, param in [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 5}}, "metadata.k"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ]:
        with pytest.raises(InvalidRequest) as info:
            check_batch_request(ok.model_copy(update=change))
        assert info.value.param == param


def test_result_lines_have_openai_shape() -> None:
    ok = success_line("a", "rid", {"object": "chat.completion"}).to_dict()
    assert ok["id"].startswith("batch_req_") and ok["custom_id"] == "a" and ok["error"] is None
    assert ok["response"] == {
        "status_code": 200,
        "request_id": "rid",
        "body": {"object": "chat.completion"},
    }
    bad = rejected_line("b", InvalidRequest("nope", param="temperature"), "rid2")
    assert not bad.ok and bad.response is not None and bad.response.status_code == 400
    assert bad.response.body["error"]["param"] == "temperature"
    assert bad.error is not None and bad.error.message == "nope"
    late = failed_line("c", "rid3", "The request exceeded its deadline.", 504)
    assert late.response is not None and late.response.body["error"]["type"] == "timeout_error"
    skipped = not_run_line("d", "batch_expired", "too late").to_dict()
    assert skipped["response"] is None and skipped["error"]["code"] == "batch_expired"
    assert BatchOutputLine.model_validate_json(bad.to_line()) == bad


def fold(kind: str = "chat", n: int = 2, logprobs: bool = False) -> ResponseFold:
    return ResponseFold(
        kind,  # type: ignore[arg-type]
        num_choices=n,
        model="m",
        response_id="id-1",
        created=5,
        logprobs=logprobs,
    )


def test_fold_builds_the_non_streaming_body() -> None:
    f = fold()
    for ev in [
        OutputEvent(OutputKind.DELTA, choice=1, text="Wor"),
        OutputEvent(OutputKind.DELTA, choice=0, text="Hel"),
        OutputEvent(OutputKind.DELTA, choice=0, text="lo"),
        OutputEvent(OutputKind.FINAL, choice=0, finish_reason=FinishReason.STOP, stop_reason="!"),
        OutputEvent(OutputKind.DELTA, choice=1, text="ld"),
        OutputEvent(OutputKind.FINAL, choice=1, finish_reason=FinishReason.LENGTH),
    ]:
        f.feed(ev)
        assert not f.done
    f.feed(
        OutputEvent(
            OutputKind.USAGE,
            usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "timings": {}},
        )
    )
    assert f.done and f.failure is None and not f.aborted
    body = f.response().to_dict()
    assert body["id"] == "id-1" and body["object"] == "chat.completion"
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello", "World"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["choices"][0]["stop_reason"] == "!"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}

    text = fold("completion", n=1)
    text.feed(OutputEvent(OutputKind.DELTA, choice=0, text="abc"))
    text.feed(OutputEvent(OutputKind.FINAL, choice=0, finish_reason=FinishReason.STOP))
    text.feed(OutputEvent(OutputKind.USAGE, usage={}))
    assert text.response().to_dict()["choices"][0]["text"] == "abc"


def test_fold_failures_and_aborts() -> None:
    f = fold()
    f.feed(OutputEvent(OutputKind.ERROR, error="No worker.", code=503))
    assert f.done and f.failure is not None and f.failure.status == 503
    g = fold(n=1)
    g.feed(OutputEvent(OutputKind.FINAL, choice=0, finish_reason=FinishReason.ERROR, code=400))
    assert not g.done  # the usage event still ends the stream
    assert g.failure is not None and g.failure.status == 400  # every choice failed
    g.feed(OutputEvent(OutputKind.USAGE, usage={}))
    assert g.done
    # n>1: one failed choice is kept in the body; the request succeeds.
    two = fold(n=2)
    two.feed(OutputEvent(OutputKind.FINAL, choice=0, finish_reason=FinishReason.ERROR, code=500))
    two.feed(OutputEvent(OutputKind.DELTA, choice=1, text="ok"))
    two.feed(OutputEvent(OutputKind.FINAL, choice=1, finish_reason=FinishReason.STOP))
    two.feed(OutputEvent(OutputKind.USAGE, usage={}))
    assert two.done and two.failure is None
    choices = two.response().to_dict()["choices"]
    assert (
        choices[0]["finish_reason"] == "error" and choices[0]["error"]["type"] == "internal_error"
    )
    assert choices[1]["message"]["content"] == "ok" and "error" not in choices[1]
    h = fold(n=1)
    h.feed(OutputEvent(OutputKind.FINAL, choice=0, finish_reason=FinishReason.CANCELLED))
    h.feed(OutputEvent(OutputKind.USAGE, usage={}))
    assert h.done and h.aborted and h.failure is None
