"""One trace per request across the fleet (issue 45): real processes export to a real
OTLP/HTTP receiver (``tests.otlp_receiver``, decoding the protobuf).

A redis-server, a Celery worker (echo engine), a streamer and a web server, each its
own process, export with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set. A streamed request that
names a parent in its ``traceparent`` yields one trace under that parent, with spans
from all three processes parented as ``broker.tracing`` says, carrying the model and
the token counts the client read; a request without one starts a trace of its own.
Each line of a batch is a trace of its own, from the batch driver's span through the
worker's and the streamer's. A stack stopped before its next export is due still
delivers a finished request's whole trace. (A stream resumed after its web process died:
tests/faults/test_tracing_resume.py.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket

from app.batches import BatchStatus
from tests.otlp_receiver import (
    CONSUMER,
    SERVER,
    WAIT_S,
    OtlpReceiver,
    chat_body,
    has,
    one,
    read_stream,
    traced_stack,
    traceparent,
)
from tests.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEB_SPAN = "POST /v1/chat/completions"
TERMINAL = {s.value for s in BatchStatus if s.terminal}


def whole(model: str) -> tuple[str, ...]:
    """The spans a finished request's trace has, one per part."""
    return (WEB_SPAN, "parse", "admission", "queue", f"chat {model}", "prefill", "decode",
            f"detokenize {model}")  # fmt: skip


def streamed_chat(s: Stack, header: str) -> dict[str, Any]:
    """A streamed chat with the client's ``traceparent``, read to its end (``read_stream``)."""
    with requests.post(
        f"{s.base_url}/v1/chat/completions",
        json=chat_body(s.settings),
        headers={"traceparent": header},
        stream=True,
        timeout=WAIT_S,
    ) as resp:
        assert resp.status_code == 200, resp.text
        return read_stream(resp)


def test_a_streamed_request_is_one_trace_across_three_processes(
    traced: Stack, otlp: OtlpReceiver
) -> None:
    header, trace_id, client_parent = traceparent()
    model = traced.settings.served_name
    got = streamed_chat(traced, header)
    assert got["done"] and got["text"], got
    usage = got["usage"]

    spans = otlp.wait_for(has(*whole(model)), WAIT_S, trace_id)
    assert {s.process for s in spans} == {"web", "worker", "streamer"}, traced.logs()
    assert len({s.pid for s in spans}) == 3  # three processes, as started
    assert sorted(s.name for s in spans) == sorted(whole(model))  # nothing twice

    root = one(spans, WEB_SPAN)
    assert root.kind == SERVER and root.process == "web"
    assert root.parent_id == client_parent  # the client's traceparent is its parent
    assert root.attributes["gen_ai.request.model"] == model
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root.event_names() == ["first_byte", "last_byte"]
    for name in ("parse", "admission"):
        assert one(spans, name).parent_id == root.span_id

    queue, gen = one(spans, "queue"), one(spans, f"chat {model}")
    assert queue.process == gen.process == "worker"
    assert queue.parent_id == gen.parent_id == root.span_id
    assert queue.end_ns == gen.start_ns  # the claim ends the wait and starts the run
    assert gen.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert gen.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert gen.attributes["tokenrelay.engine.finish_reasons"] == ["eos"]
    assert gen.attributes["tokenrelay.attempt"] == 0
    prefill, decode = one(spans, "prefill"), one(spans, "decode")
    assert prefill.parent_id == decode.parent_id == gen.span_id
    assert prefill.end_ns == decode.start_ns  # the first token
    # The echo engine gives each choice one token per step (its EOS ends the last).
    assert decode.attributes["tokenrelay.steps"] >= usage["completion_tokens"] - 1
    assert decode.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]

    relay = one(spans, f"detokenize {model}")
    assert relay.process == "streamer" and relay.parent_id == root.span_id
    assert relay.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert relay.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert relay.event_names() == ["first_token"]
    assert all(s.trace_id == trace_id for s in spans)


def test_a_process_that_stops_exports_the_spans_it_holds(
    otlp: OtlpReceiver, models_dir: Path, tmp_path: Path
) -> None:
    """Spans wait in each process for the next export (every 15 s unless the delay is
    set: broker.tracing): a stack stopped before it is due loses none of a finished
    request's trace, each process exporting what it holds as it exits."""
    header, trace_id, _ = traceparent()
    with traced_stack(otlp, models_dir, tmp_path, export_delay_ms=600_000) as s:
        model = s.settings.served_name
        assert streamed_chat(s, header)["done"]
        time.sleep(0.5)  # the web's span ends with the last byte, just after the client's read
        assert otlp.spans(trace_id) == []  # none due yet: each process holds its spans
    spans = otlp.wait_for(has(*whole(model)), WAIT_S, trace_id)
    assert sorted(sp.name for sp in spans) == sorted(whole(model))
    assert {sp.process for sp in spans} == {"web", "worker", "streamer"}


def test_without_a_traceparent_a_trace_is_started(traced: Stack, otlp: OtlpReceiver) -> None:
    before = {s.trace_id for s in otlp.spans()}
    resp = requests.post(
        f"{traced.base_url}/v1/chat/completions",
        json={
            **chat_body(traced.settings),
            "stream": False,
            "stream_options": None,
            "max_tokens": 8,
        },
        timeout=WAIT_S,
    )
    assert resp.status_code == 200, resp.text

    def new_trace() -> str | None:
        fresh = [s for s in otlp.spans() if s.trace_id not in before and s.name == WEB_SPAN]
        return fresh[0].trace_id if fresh else None

    deadline = time.monotonic() + WAIT_S
    while (trace_id := new_trace()) is None:
        assert time.monotonic() < deadline, "no web span arrived"
        time.sleep(0.05)
    spans = otlp.wait_for(has(*whole(traced.settings.served_name)), WAIT_S, trace_id)
    assert one(spans, WEB_SPAN).parent_id == ""  # a root: the trace started here
    relay = one(spans, f"detokenize {traced.settings.served_name}")
    assert relay.attributes["gen_ai.response.finish_reasons"] == ["length"]


def test_a_refused_request_is_one_web_span_with_its_error(
    traced: Stack, otlp: OtlpReceiver
) -> None:
    header, trace_id, client_parent = traceparent()
    resp = requests.post(
        f"{traced.base_url}/v1/chat/completions",
        json={**chat_body(traced.settings), "max_tokens": -1},
        headers={"traceparent": header},
        timeout=WAIT_S,
    )
    assert resp.status_code == 400, resp.text
    spans = otlp.wait_for(has(WEB_SPAN, "parse"), WAIT_S, trace_id)
    root = one(spans, WEB_SPAN)
    assert root.parent_id == client_parent
    assert root.attributes["http.response.status_code"] == 400
    assert root.attributes["error.type"] == "invalid_request_error"
    assert one(spans, "parse").attributes["error.type"] == "InvalidRequest"
    time.sleep(0.5)  # nothing else comes: it never reached a queue
    assert {s.name for s in otlp.spans(trace_id)} == {WEB_SPAN, "parse"}


def test_a_websocket_request_continues_the_handshake_trace(
    traced: Stack, otlp: OtlpReceiver
) -> None:
    header, trace_id, client_parent = traceparent()
    url = traced.base_url.replace("http://", "ws://") + "/v1/ws"
    ws = websocket.create_connection(url, timeout=WAIT_S, header=[f"traceparent: {header}"])
    try:
        ws.send(
            json.dumps(
                {"type": "chat", "id": "t", "messages": [{"role": "user", "content": "hi there"}]}
            )
        )
        while json.loads(ws.recv())["type"] != "done":
            pass
    finally:
        ws.close()
        ws.shutdown()
    model = traced.settings.served_name
    spans = otlp.wait_for(has("/v1/ws", f"chat {model}", f"detokenize {model}"), WAIT_S,
                              trace_id)  # fmt: skip
    root = one(spans, "/v1/ws")
    assert root.kind == SERVER and root.parent_id == client_parent
    assert root.attributes["network.protocol.name"] == "websocket"
    assert one(spans, f"chat {model}").parent_id == root.span_id


def start_batch(
    base: str, model: str, route: str, custom_ids: tuple[str, ...], text: str = ""
) -> str:
    """A batch of one chat per custom id (its id and ``text`` as the prompt, which the
    echo engine repeats), created: its id."""

    def line(cid: str) -> str:
        body = {"model": model, "max_tokens": 400,
                "messages": [{"role": "user", "content": f"{cid} {text}"}]}  # fmt: skip
        return json.dumps({"custom_id": cid, "method": "POST", "url": route, "body": body})

    data = "".join(line(cid) + "\n" for cid in custom_ids).encode()
    up = requests.post(
        f"{base}/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"},
        timeout=WAIT_S,
    )  # fmt: skip
    assert up.status_code == 200, up.text
    made = requests.post(
        f"{base}/v1/batches",
        json={"input_file_id": up.json()["id"], "endpoint": route, "completion_window": "24h"},
        timeout=WAIT_S,
    )
    assert made.status_code == 200, made.text
    return str(made.json()["id"])


def finish_batch(base: str, batch_id: str) -> dict[str, Any]:
    """Wait for the batch to complete; each line's usage (from the output file)."""
    deadline = time.monotonic() + WAIT_S
    while (batch := requests.get(f"{base}/v1/batches/{batch_id}", timeout=WAIT_S).json())[
        "status"
    ] != "completed":
        assert time.monotonic() < deadline and batch["status"] not in TERMINAL, batch
        time.sleep(0.2)
    out = requests.get(f"{base}/v1/files/{batch['output_file_id']}/content", timeout=WAIT_S)
    results = [json.loads(text) for text in out.text.splitlines()]
    return {r["custom_id"]: r["response"]["body"]["usage"] for r in results}


def line_spans(otlp: OtlpReceiver, name: str, batch_id: str, lines: int) -> dict[str, Any]:
    """The batch's spans called ``name``, by custom id, once there are ``lines``."""

    def spans() -> dict[str, Any]:
        return {
            s.attributes["tokenrelay.batch.custom_id"]: s
            for s in otlp.spans()
            if s.name == name and s.attributes.get("tokenrelay.batch.id") == batch_id
        }

    deadline = time.monotonic() + WAIT_S
    while len(got := spans()) < lines:
        assert time.monotonic() < deadline, f"no {name} spans of {batch_id} arrived"
        time.sleep(0.05)
    return got


def test_each_batch_line_is_a_trace_across_driver_worker_and_streamer(
    traced: Stack, otlp: OtlpReceiver
) -> None:
    model, route, base = traced.settings.served_name, "/v1/chat/completions", traced.base_url
    batch_id = start_batch(base, model, route, ("line-a", "line-b"))
    usage = finish_batch(base, batch_id)
    line_span = f"batch {route}"
    lines = line_spans(otlp, line_span, batch_id, 2)
    assert len({r.trace_id for r in lines.values()}) == 2  # a trace per line
    for index, (cid, root) in enumerate(sorted(lines.items())):
        spans = otlp.wait_for(
            has(line_span, "queue", f"chat {model}", "prefill", "decode", f"detokenize {model}"),
            WAIT_S,
            root.trace_id,
        )
        assert {s.process for s in spans} == {"batcher", "worker", "streamer"}, traced.logs()
        assert root.parent_id == "" and root.kind == CONSUMER and root.process == "batcher"
        assert root.attributes["tokenrelay.batch.line"] == index + 1
        assert root.attributes["gen_ai.request.model"] == model
        assert root.attributes["gen_ai.usage.output_tokens"] == usage[cid]["completion_tokens"]
        assert root.attributes["http.response.status_code"] == 200
        for name in ("queue", f"chat {model}", f"detokenize {model}"):
            assert one(spans, name).parent_id == root.span_id
        relay = one(spans, f"detokenize {model}")
        assert relay.attributes["gen_ai.usage.output_tokens"] == usage[cid]["completion_tokens"]
