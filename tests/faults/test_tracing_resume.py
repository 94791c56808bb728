"""A stream resumed after its web process died continues the request's trace (issue 45).

A traced stack (``tests.otlp_receiver.traced_stack``: worker, streamer, web B, each its
own process, exporting to a real OTLP/HTTP receiver) and web A, started for the test.
A stream with the client's ``traceparent`` starts on A; part of it is read; A's process
group is SIGKILLed (its request span dies with it, unexported); the client resumes on
B with ``Last-Event-ID``. B's ``resume`` span is in the same trace, under the request's
span (the parent A's ``parse`` and ``admission`` spans name), and the worker and the
streamer add theirs there too.

The same for a batch line whose batch driver is SIGKILLed: the driver that takes the
batch over makes a ``resume batch <route>`` span in each running line's trace, under
the line's span (lost with the killed driver), as the worker's and streamer's are.
"""

from __future__ import annotations

import pytest
import redis
import requests

from broker.keys import Keys
from broker.requests import RequestStore
from tests.e2e.test_tracing import finish_batch, line_spans, start_batch
from tests.otlp_receiver import (
    SERVER,
    WAIT_S,
    OtlpReceiver,
    chat_body,
    has,
    one,
    read_stream,
    traceparent,
)
from tests.stack import Stack, batcher_process, wait_for, web_process, web_settings
from workers.batch_state import line_request_id

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def test_a_stream_resumed_after_its_web_process_died_continues_its_trace(
    traced: Stack, otlp: OtlpReceiver
) -> None:
    model = traced.settings.served_name
    a = web_settings(traced.settings)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.url)
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        web_a = traced.start("web-a", web_process(a, traced.log_dir, name="web-a"))
    header, trace_id, client_parent = traceparent()
    resp = requests.post(
        f"http://{a.host}:{a.port}/v1/chat/completions",
        json=chat_body(traced.settings),
        headers={"traceparent": header},
        stream=True,
        timeout=WAIT_S,
    )
    assert resp.status_code == 200, resp.text
    rid = resp.headers["x-request-id"]
    first = read_stream(resp, stop_after=5)
    assert first["last_id"] and not first["done"], first
    # A's admission span has arrived: its parent is the request's span, which dies
    # with A (a span is exported when it ends).
    spans = otlp.wait_for(has("admission"), WAIT_S, trace_id)
    request_span = one(spans, "admission").parent_id
    web_a.kill_group()
    resp.close()

    with requests.get(
        f"{traced.base_url}/v1/streams/{rid}",
        headers={"Last-Event-ID": first["last_id"], "traceparent": traceparent()[0]},
        stream=True,
        timeout=WAIT_S,
    ) as resumed:
        assert resumed.status_code == 200, resumed.text
        rest = read_stream(resumed)
    assert rest["done"], rest

    resume_name = "resume /v1/chat/completions"
    spans = otlp.wait_for(
        has(resume_name, f"chat {model}", f"detokenize {model}"), WAIT_S, trace_id
    )
    resume = one(spans, resume_name)
    assert resume.kind == SERVER and resume.process == "web"
    assert resume.parent_id == request_span != client_parent
    assert resume.pid != one(spans, "admission").pid  # another web process
    assert resume.attributes["tokenrelay.resumed"] is True
    assert len(resume.links) == 1  # the resuming client's own context, as a link
    assert resume.attributes["http.response.status_code"] == 200
    assert one(spans, f"chat {model}").parent_id == request_span
    assert one(spans, f"detokenize {model}").parent_id == request_span
    assert {s.process for s in spans} == {"web", "worker", "streamer"}
    assert all(s.trace_id == trace_id for s in spans)
    assert "POST /v1/chat/completions" not in {s.name for s in spans}  # died with A


def test_a_batch_line_taken_over_by_another_driver_continues_its_trace(
    traced: Stack, otlp: OtlpReceiver
) -> None:
    model, route, base = traced.settings.served_name, "/v1/chat/completions", traced.base_url
    # Each line streams for ~5 s (~200 tokens at 40 a second): the driver dies mid-line.
    text = " ".join(f"w{i}" for i in range(70))
    batch_id = start_batch(base, model, route, ("slow-a", "slow-b"), text)
    rids = [line_request_id(batch_id, i) for i in range(2)]
    with redis.Redis.from_url(traced.settings.redis_url) as client:
        store = RequestStore(client, Keys(traced.settings.key_prefix))
        wait_for(lambda: all(store.load(r) for r in rids), WAIT_S, "both lines submitted")
        first = {r: store.load(r)[0].trace for r in rids}  # type: ignore[index]
        client.connection_pool.disconnect()
    traced.procs["batcher"].kill()  # SIGKILL: its line spans die unexported
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.url)
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        took_over = traced.start(
            "batcher-2", batcher_process(traced.settings, traced.log_dir, name="batcher-2")
        )
    usage = finish_batch(base, batch_id)
    resumed = line_spans(otlp, f"resume batch {route}", batch_id, 2)
    for index, (cid, span) in enumerate(sorted(resumed.items())):
        assert span.process == "batcher" and span.pid == took_over.pid
        assert span.attributes["tokenrelay.resumed"] is True
        assert span.attributes["gen_ai.usage.output_tokens"] == usage[cid]["completion_tokens"]
        carrier = first[rids[index]]  # the line's span, as its record names it
        trace_id, line_span = carrier["traceparent"].split("-")[1:3]
        assert (span.trace_id, span.parent_id) == (trace_id, line_span)
        spans = otlp.wait_for(
            has("queue", f"chat {model}", f"detokenize {model}"), WAIT_S, trace_id
        )
        for name in ("queue", f"chat {model}", f"detokenize {model}"):
            assert one(spans, name).parent_id == line_span  # the same trace throughout
