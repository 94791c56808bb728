"""The official ``anthropic`` SDK, unmodified, against a running stack (issue 42):
``messages.create``, ``messages.stream``, a two-step tool loop, ``count_tokens``, errors
in Anthropic's shape, and a stream resumed after a lost connection. The echo engine
repeats the last user message, so every text is known exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
import requests

from tests.stack import Stack, full_stack, isolated_settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "k-anthropic-test"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings("redis://unused", models_dir, api_keys=[KEY], web_threads=16)
    with full_stack(settings, tmp_path_factory.mktemp("anthropic-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=stack.base_url, api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    return stack.settings.served_name


def call_text(arguments: dict[str, Any]) -> str:
    body = json.dumps({"name": "get_weather", "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


def test_create(client: anthropic.Anthropic, model: str) -> None:
    text = "Hello there, how are you today?"
    message = client.messages.create(
        model=model,
        max_tokens=64,
        system="Be brief.",
        messages=[{"role": "user", "content": text}],
    )
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.model == model and message.stop_reason == "end_turn"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == text  # type: ignore[union-attr]
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_stream_text_and_final_message(client: anthropic.Anthropic, model: str) -> None:
    text = "one two three four five six"
    with client.messages.stream(
        model=model, max_tokens=64, messages=[{"role": "user", "content": text}]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text and len(pieces) > 1
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_stop_sequences_and_max_tokens(client: anthropic.Anthropic, model: str) -> None:
    message = client.messages.create(
        model=model,
        max_tokens=64,
        stop_sequences=["STOP"],
        messages=[{"role": "user", "content": "go on and STOP here"}],
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
    assert message.content[0].text == "go on and "  # type: ignore[union-attr]
    short = client.messages.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": "a b c d e f g h"}]
    )
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_a_two_step_tool_loop(client: anthropic.Anthropic, model: str) -> None:
    arguments = {"city": "Paris", "days": 3}
    first = client.messages.create(
        model=model,
        max_tokens=128,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[{"role": "user", "content": call_text(arguments)}],
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == arguments
    second = client.messages.create(
        model=model,
        max_tokens=128,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": call_text(arguments)},
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"},
                    {"type": "text", "text": "Thanks, so it is sunny."},
                ],
            },
        ],
    )
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "Thanks, so it is sunny."  # type: ignore[union-attr]


def test_streamed_tool_input_arrives_in_json_deltas(
    client: anthropic.Anthropic, model: str
) -> None:
    arguments = {"city": "Oslo", "days": 5}
    with client.messages.stream(
        model=model,
        max_tokens=128,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": call_text(arguments)}],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(partial) > 2 and json.loads("".join(partial)) == arguments
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.input == arguments and final.stop_reason == "tool_use"


def test_count_tokens(client: anthropic.Anthropic, model: str, stack: Stack) -> None:
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = client.messages.count_tokens(model=model, messages=messages)  # type: ignore[arg-type]
    chat = requests.post(
        f"{stack.base_url}/tokenize",
        json={"model": model, "messages": messages},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
    ).json()
    assert counted.input_tokens == chat["count"] > 0


def test_errors_have_anthropic_s_shape(stack: Stack, model: str) -> None:
    bad = anthropic.Anthropic(base_url=stack.base_url, api_key="wrong", max_retries=0)
    with bad, pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "x"}])
    with anthropic.Anthropic(base_url=stack.base_url, api_key=KEY, max_retries=0) as ok:
        with pytest.raises(anthropic.NotFoundError):
            ok.messages.create(
                model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}]
            )
        with pytest.raises(anthropic.BadRequestError) as err:
            ok.messages.create(
                model=model,
                max_tokens=8,
                messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
            )
    assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    raw = requests.post(
        f"{stack.base_url}/v1/messages",
        json={"model": model, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        timeout=10,
    )
    assert raw.status_code == 400
    assert raw.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": raw.json()["error"]["message"]},
    }
    assert "max_tokens" in raw.json()["error"]["message"]


def sse_events(raw: str) -> list[tuple[str | None, str, dict[str, Any]]]:
    """(id, event, data) of each SSE event, pings left out."""
    out = []
    for block in raw.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if fields and fields.get("event") != "ping":
            out.append((fields.get("id"), fields["event"], json.loads(fields["data"])))
    return out


def test_a_lost_stream_resumes_after_the_last_event_id(stack: Stack, model: str) -> None:
    text = "alpha beta gamma delta epsilon zeta eta theta"
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    body = {
        "model": model,
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": text}],
    }
    whole = requests.post(f"{stack.base_url}/v1/messages", json=body, headers=headers, timeout=30)
    events = sse_events(whole.text)
    names = [e[1] for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and "content_block_stop" in names
    rid = whole.headers["request-id"]
    ids = [e[0] for e in events]
    assert None not in ids and len(set(ids)) == len(ids), ids  # every event its own id
    # After any event the client processed (a connection may break between two events
    # one output event made: a block's start and its first delta, the block's stop and
    # the message's delta): exactly the events after it.
    for cut in range(1, len(events)):
        rest = requests.get(
            f"{stack.base_url}/v1/streams/{rid}",
            headers={**headers, "Last-Event-ID": str(ids[cut - 1])},
            timeout=30,
        )
        assert sse_events(rest.text) == events[cut:], f"after {events[cut - 1][:2]}"
    # An id sent before events had their own (``<cursor>`` alone) names every event
    # of its cursor; a chat stream's cursor takes no event place.
    old = str(ids[-1]).rsplit("/", 1)[0]
    rest = requests.get(
        f"{stack.base_url}/v1/streams/{rid}",
        headers={**headers, "Last-Event-ID": old},
        timeout=30,
    )
    assert sse_events(rest.text) == []
    deltas = [e[2]["delta"]["text"] for e in events if e[1] == "content_block_delta"]
    assert "".join(deltas) == text
