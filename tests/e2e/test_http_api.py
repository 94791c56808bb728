"""The HTTP API on the wire (``requests``, no SDK): SSE framing byte for byte, the stop
cases over SSE and JSON, metrics across gunicorn workers, and disconnects."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from app.model_card import load_model_card, load_tokenizer
from broker.keys import Keys
from broker.requests import RequestStore
from tests.e2e.conftest import in_flight
from tests.e2e.stop_cases import CASES, chat_body, expected
from tests.stack import Stack, wait_for
from web.metrics_docs import cluster_metric_docs, metric_docs

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"


def read_sse(resp: requests.Response) -> list[Any]:
    """The payloads of an SSE response, asserting OpenAI's framing on the raw bytes."""
    raw = resp.content.decode("utf-8")
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    payloads: list[Any] = []
    for block in raw.split("\n\n")[:-1]:
        if block.startswith(":"):  # a keep-alive comment
            continue
        if block.startswith("id: "):  # the resume cursor (docs/api.md)
            event_id, _, block = block.partition("\n")
            assert re.fullmatch(r"id: \d+/\d+", event_id), event_id
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: ") :]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    assert payloads.pop() == "[DONE]"
    assert "[DONE]" not in payloads
    return payloads


def fold_chat_chunks(chunks: list[dict[str, Any]]) -> dict[int, tuple[str, str, Any]]:
    """Per choice: (text, finish_reason, stop_reason) from streamed chat chunks."""
    text: dict[int, str] = {}
    ends: dict[int, tuple[str, Any]] = {}
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            text[c["index"]] = text.get(c["index"], "") + c["delta"].get("content", "")
            if c["finish_reason"] is not None:
                assert c["index"] not in ends
                ends[c["index"]] = (c["finish_reason"], c["stop_reason"])
    return {i: (text[i], *ends[i]) for i in text}


def test_sse_framing_and_headers(stack: Stack) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi there"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = requests.post(stack.base_url + CHAT, json=body, timeout=30)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["Cache-Control"] == "no-cache"
    assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["x-request-id"])
    chunks = read_sse(resp)
    assert chunks[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
        "refusal": None,
    }
    assert chunks[0]["id"] == "chatcmpl-" + resp.headers["x-request-id"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert set(chunks[-1]["usage"]) <= {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    assert fold_chat_chunks(chunks[:-1]) == {0: ("Hi there", "stop", None)}
    echoed = requests.post(
        stack.base_url + CHAT, json=body, headers={"X-Request-Id": "mine-42"}, timeout=30
    )
    assert echoed.headers["x-request-id"] == "mine-42"


@pytest.mark.parametrize("case", sorted(CASES))
def test_stop_cases_same_text_over_sse_and_json(stack: Stack, model_dir: Path, case: str) -> None:
    model = stack.settings.served_name
    tokenizer = load_tokenizer(load_model_card(model_dir))
    body = chat_body(case, model, tokenizer)
    want = expected(case, model_dir, model)
    want_choices = {
        i: (want.texts[i], want.finish_reasons[i], want.stop_reasons[i]) for i in want.texts
    }

    plain = requests.post(stack.base_url + CHAT, json=body, timeout=30)
    assert plain.status_code == 200, plain.text
    data = plain.json()
    got_plain = {
        c["index"]: (c["message"]["content"], c["finish_reason"], c["stop_reason"])
        for c in data["choices"]
    }
    streamed = requests.post(stack.base_url + CHAT, json={**body, "stream": True}, timeout=30)
    got_sse = fold_chat_chunks(read_sse(streamed))

    assert got_plain == want_choices
    assert got_sse == want_choices
    assert data["usage"]["completion_tokens"] == want.completion_tokens


def metric_value(base_url: str, name: str, labels: str) -> float:
    text = requests.get(base_url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_metrics_count_every_worker(stack: Stack) -> None:
    labels = 'endpoint="/v1/models",error_type="",status="200"'
    before = metric_value(stack.base_url, "tokenrelay_requests_total", labels)
    for _ in range(8):  # one connection each, so both gunicorn workers answer some
        assert requests.get(stack.base_url + "/v1/models", timeout=10).status_code == 200
    after = metric_value(stack.base_url, "tokenrelay_requests_total", labels)
    assert after - before == 8
    text = requests.get(stack.base_url + "/metrics", timeout=10).text
    for name in (
        "tokenrelay_time_to_first_token_seconds_bucket",
        "tokenrelay_e2e_request_latency_seconds_count",
        "tokenrelay_queue_time_seconds_count",
        "tokenrelay_inter_token_latency_seconds_count",
        "tokenrelay_requests_in_flight",
        "tokenrelay_prompt_tokens_total",
        "tokenrelay_completion_tokens_total",
    ):
        assert name in text, name
    # Every family of this multiprocess scrape is in docs/operations.md's table with its
    # type; those read from Redis are in every scrape, the web tier's own once sampled.
    exposed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)).items()
    assert exposed <= {(d.name, d.type) for d in metric_docs()}
    assert {(d.name, d.type) for d in cluster_metric_docs()} <= exposed


def test_ready_and_http_errors_on_the_wire(stack: Stack) -> None:
    ready = requests.get(stack.base_url + "/ready", timeout=10).json()
    assert ready["status"] == "ready"
    assert ready["workers"] and all(w["mode"] and w["capacity"] >= 1 for w in ready["workers"])
    cases = [
        (requests.get(stack.base_url + "/v1/nowhere", timeout=10), 404),
        (requests.get(stack.base_url + CHAT, timeout=10), 405),
        (requests.post(stack.base_url + CHAT, data="x", timeout=10), 415),
        (
            requests.post(
                stack.base_url + CHAT,
                data=b"{not json",
                headers={"Content-Type": "application/json"},
                timeout=10,
            ),
            400,
        ),
    ]
    for resp, status in cases:
        assert resp.status_code == status
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in resp.text and "werkzeug" not in resp.text.lower()


def test_disconnect_stops_the_worker_within_a_second(slow_stack: Stack) -> None:
    settings = slow_stack.settings
    body = {"messages": [{"role": "user", "content": "word " * 200}], "stream": True}
    resp = requests.post(slow_stack.base_url + CHAT, json=body, stream=True, timeout=30)
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    lines = resp.iter_lines()
    while b'"content":"word' not in next(lines):
        pass
    resp.close()  # the client goes away mid-stream

    store = RequestStore(redis.Redis.from_url(settings.redis_url), Keys(settings.key_prefix))

    def published() -> int:
        return sum(len(p.token_ids) for p in store.progress(rid, 1))

    time.sleep(1.0)
    after_one_second = published()
    time.sleep(1.0)
    assert published() == after_one_second, "the worker still generates 1 s after"
    assert after_one_second < 100  # of 200: it stopped long before the end
    wait_for(lambda: in_flight(settings) == 0, 5, "the admission slot to be released")
    disconnects = metric_value(
        slow_stack.base_url,
        "tokenrelay_client_disconnects_total",
        f'endpoint="/v1/chat/completions",model="{slow_stack.settings.served_name}"',
    )
    assert disconnects >= 1


def test_a_non_streaming_client_that_hangs_up_cancels_within_a_second(
    slow_stack: Stack,
) -> None:
    """Seed 001 watches a unary request's connection too: the generation is cancelled
    and counted as 499."""
    import socket

    settings = slow_stack.settings
    model = settings.served_name
    labels = f'endpoint="/v1/chat/completions",mode="unary",model="{model}"'
    before = metric_value(slow_stack.base_url, "tokenrelay_requests_cancelled_total", labels)
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 200}]}).encode()
    host, port = settings.host, settings.port
    sock = socket.create_connection((host, port), timeout=10)
    sock.sendall(
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    r = redis.Redis.from_url(settings.redis_url)
    keys = Keys(settings.key_prefix)
    store = RequestStore(r, keys)
    wait_for(lambda: in_flight(settings) == 1, 10, "the request to be admitted")
    (rid,) = [m.decode() for m in r.zrange(keys.inflight, 0, -1)]
    time.sleep(0.5)  # generating
    sock.close()  # the client hangs up without reading a byte
    closed_at = time.monotonic()
    wait_for(lambda: store.is_cancelled(rid), 2, "the hang-up to cancel the request")
    assert time.monotonic() - closed_at < 1.0
    wait_for(lambda: in_flight(settings) == 0, 3, "the slot to be released")
    wait_for(
        lambda: (
            metric_value(slow_stack.base_url, "tokenrelay_requests_cancelled_total", labels)
            > before
        ),
        3,
        "the cancel to be counted",
    )


def test_metrics_show_the_workers_and_queues(stack: Stack) -> None:
    """Worker gauges come from the workers' heartbeats in Redis, read at scrape time."""
    body = {
        "model": stack.settings.served_name,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "count these tokens please"}],
    }
    assert requests.post(stack.base_url + CHAT, json=body, timeout=30).status_code == 200

    def produced() -> float:
        text = requests.get(stack.base_url + "/metrics", timeout=10).text
        match = re.search(r"^tokenrelay_worker_tokens_total\{[^}]*\} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    wait_for(lambda: produced() > 0, 15, "the worker's heartbeat to report tokens")
    text = requests.get(stack.base_url + "/metrics", timeout=10).text
    for name in (
        "tokenrelay_worker_batch_size",
        "tokenrelay_worker_capacity",
        "tokenrelay_worker_steps_total",
        "tokenrelay_queue_depth",
        "tokenrelay_streamers_live 1.0",
    ):
        assert name in text, name


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(stack: Stack) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (issue 42): each content chunk
    carries the usage so far, growing to the final usage chunk's, and the text is the
    same as without it."""
    text = "one two three four five six seven eight"
    body = {
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    resp = requests.post(stack.base_url + CHAT, json=body, timeout=60)
    chunks = read_sse(resp)
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == text
    so_far = [c["usage"]["completion_tokens"] for c in content]
    assert so_far == sorted(so_far) and so_far[0] >= 1 and len(set(so_far)) > 1
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] >= so_far[-1]
    assert {c["usage"]["prompt_tokens"] for c in content} == {final["usage"]["prompt_tokens"]}
