"""The Responses API through the official openai SDK against a real stack (echo engine:
the "model" answers with the last user message, so every text is known)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import websocket
from openai.types.responses import Response
from pydantic import BaseModel

from tests.e2e.conftest import SLOW_RATE, in_flight
from tests.stack import Stack, batcher_process, wait_for, web_process, web_settings

pytestmark = pytest.mark.e2e

TEXT = "Hello there, my friend! How is 東京 today?"
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with sdk(stack.base_url) as c:
        yield c


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    return stack.settings.served_name


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_create_plain(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(
        model=model, input=TEXT, instructions="Be brief.", metadata={"case": "plain"}
    )
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == TEXT
    (message,) = r.output
    assert message.type == "message" and message.status == "completed"
    assert r.usage is not None and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.metadata == {"case": "plain"} and r.instructions == "Be brief."
    # Stored by default: the same object comes back, and its input items.
    again = client.responses.retrieve(r.id)
    assert again.output_text == TEXT and again.status == "completed"
    items = client.responses.input_items.list(r.id)
    (item,) = items.data
    assert item.type == "message" and item.role == "user"


def test_max_output_tokens_is_incomplete(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, input=TEXT, max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert TEXT.startswith(r.output_text) and r.output_text


def test_stream_with_the_sdk_helper(client: openai.OpenAI, model: str) -> None:
    with client.responses.stream(model=model, input=TEXT) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == TEXT and final.output_text == TEXT
    assert client.responses.retrieve(final.id).output_text == TEXT
    # A stored stream replays from any event: the same events, the same numbers.
    replay = list(client.responses.retrieve(final.id, stream=True, starting_after=3))
    assert [(e.type, e.sequence_number) for e in replay] == [
        (e.type, e.sequence_number) for e in events[4:]
    ]


def test_function_tool_with_named_tool_choice(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(
        model=model,
        input=call("get_weather", {"city": "Paris"}),
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (fc,) = r.output
    assert fc.type == "function_call" and fc.name == "get_weather"
    assert json.loads(fc.arguments) == {"city": "Paris"} and fc.call_id.startswith("call_")
    assert r.status == "completed"
    # The tool loop: the output goes back with previous_response_id.
    second = client.responses.create(
        model=model,
        previous_response_id=r.id,
        input=[
            {"type": "function_call_output", "call_id": fc.call_id, "output": "22 C"},
            {"role": "user", "content": "It is 22 C in Paris."},
        ],
        tools=[WEATHER],
    )
    assert second.output_text == "It is 22 C in Paris."
    assert second.previous_response_id == r.id


def test_streamed_function_call_events(client: openai.OpenAI, model: str) -> None:
    with client.responses.stream(
        model=model,
        input=call("get_weather", {"city": "Oslo"}),
        tools=[WEATHER],
        tool_choice="required",
    ) as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    (event,) = done
    assert json.loads(event.arguments) == {"city": "Oslo"}
    assert final.output[0].type == "function_call"


def test_function_call_arguments_stream_in_deltas(client: openai.OpenAI, model: str) -> None:
    """Issue 42: ``response.function_call_arguments.delta`` as the model writes them;
    they join to the ``.done`` arguments and to the non-streamed call's."""
    arguments = {"city": "Oslo", "unit": "celsius", "days": 3, "detail": "hourly"}
    text = call("get_weather", arguments)
    plain = client.responses.create(model=model, input=text, tools=[WEATHER])
    with client.responses.stream(model=model, input=text, tools=[WEATHER]) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 3 and "".join(deltas) == done.arguments
    assert plain.output[0].type == "function_call"
    assert plain.output[0].arguments == done.arguments
    assert json.loads(done.arguments) == arguments


class Person(BaseModel):
    name: str
    age: int


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    # The echo engine ignores the constraint (the llama.cpp tests check the grammar):
    # this checks the wire: text.format's strict schema is accepted and parse() reads it.
    r = client.responses.parse(model=model, input='{"name": "Ada", "age": 36}', text_format=Person)
    assert r.output_parsed == Person(name="Ada", age=36)
    assert r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema"


def test_previous_response_id_chains_the_conversation(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="My name is Ada.")
    second = client.responses.create(
        model=model, previous_response_id=first.id, input="What is my name?"
    )
    assert second.output_text == "What is my name?"
    alone = client.responses.create(model=model, input="What is my name?", store=False)
    # The chained prompt holds the first turn and its answer.
    assert first.usage is not None and second.usage is not None and alone.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    third = client.responses.create(model=model, previous_response_id=second.id, input="Bye.")
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens
    # store=False: not retrievable, and cannot be continued from.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=model, previous_response_id=alone.id, input="x")
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_delete(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, input="Short.")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"max_output_tokens": 10**7}, "max_output_tokens"),
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "t",
                        "schema": {"type": "array", "uniqueItems": True},
                    }
                }
            },
            "text.format.schema",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
    ],
)
def test_unsupported_fields_are_a_400_naming_them(
    stack: Stack, model: str, extra: dict[str, Any], param: str
) -> None:
    r = requests.post(
        f"{stack.base_url}/v1/responses", json={"model": model, "input": "x", **extra}, timeout=30
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_responses_belong_to_their_api_key(stack: Stack) -> None:
    alpha, beta, admin = "k-alpha", "k-beta", "k-admin"
    settings = web_settings(
        stack.settings,
        api_keys=[alpha, beta, admin],
        admin_api_keys=[admin],
        web_workers=1,
        web_threads=8,
    )
    with web_process(settings, stack.log_dir, name="web-responses-keys"), ExitStack() as stack_exit:
        url = f"http://{settings.host}:{settings.port}/v1"
        a, b, root = (
            stack_exit.enter_context(
                openai.OpenAI(base_url=url, api_key=k, max_retries=0, timeout=30)
            )
            for k in (alpha, beta, admin)
        )
        r = a.responses.create(model=settings.served_name, input="Mine.")
        assert a.responses.retrieve(r.id).output_text == "Mine."
        for attempt in (
            lambda: b.responses.retrieve(r.id),
            lambda: b.responses.retrieve(r.id, stream=True),
            lambda: b.responses.input_items.list(r.id),
            lambda: b.responses.cancel(r.id),
            lambda: b.responses.delete(r.id),
            lambda: b.responses.create(
                model=settings.served_name, previous_response_id=r.id, input="x"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert root.responses.retrieve(r.id).output_text == "Mine."  # an admin key sees all
        a.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            root.responses.retrieve(r.id)


def test_batch_lines_of_the_responses_endpoint(
    stack: Stack, client: openai.OpenAI, model: str, tmp_path: Path
) -> None:
    lines = [
        {
            "custom_id": "plain",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": model, "input": TEXT, "metadata": {"n": "1"}},
        },
        {
            "custom_id": "tool",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": model,
                "input": call("get_weather", {"city": "Rome"}),
                "tools": [WEATHER],
                "tool_choice": "required",
            },
        },
        {
            "custom_id": "chained",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": model, "input": "x", "previous_response_id": "resp_x"},
        },
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    with batcher_process(stack.settings, tmp_path):
        upload = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id is not None
    out = {
        line["custom_id"]: line
        for line in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
    }
    plain = Response.model_validate(out["plain"]["response"]["body"])
    assert plain.output_text == TEXT and plain.status == "completed"
    assert plain.metadata == {"n": "1"} and plain.usage is not None
    tool = Response.model_validate(out["tool"]["response"]["body"])
    (fc,) = tool.output
    assert fc.type == "function_call" and json.loads(fc.arguments) == {"city": "Rome"}
    assert batch.error_file_id is not None
    (err,) = map(json.loads, client.files.content(batch.error_file_id).text.splitlines())
    assert err["custom_id"] == "chained"
    assert err["response"]["body"]["error"]["param"] == "previous_response_id"


def test_websocket_response_messages(stack: Stack, client: openai.OpenAI, model: str) -> None:
    ws = websocket.create_connection(stack.base_url.replace("http", "ws") + "/v1/ws", timeout=15)
    try:
        ws.send(json.dumps({"type": "response", "id": "r1", "model": model, "input": TEXT}))
        ws.send(
            json.dumps(
                {"type": "response", "id": "bad", "input": "x", "tools": [{"type": "web_search"}]}
            )
        )
        by_id: dict[str, list[dict[str, Any]]] = {"r1": [], "bad": []}
        done: set[str] = set()
        while done != {"r1", "bad"}:
            message = json.loads(ws.recv())
            if message["type"] == "done":
                done.add(message["id"])
            else:
                by_id[message["id"]].append(message)
    finally:
        ws.close()
    started, *events = by_id["r1"]
    assert started["type"] == "started" and started["response_id"].startswith("resp_")
    typed = [m["event"] for m in events]
    assert all(m["type"] == "response_event" for m in events)
    assert [e["sequence_number"] for e in typed] == list(range(len(typed)))
    assert typed[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in typed if e["type"] == "response.output_text.delta") == TEXT
    # Stored like an HTTP response: retrievable, and a conversation to continue.
    assert client.responses.retrieve(started["response_id"]).output_text == TEXT
    (error,) = by_id["bad"]
    assert error["type"] == "error" and error["error"]["param"] == "tools[0].type"


# -- background (slow stack: 20 tokens/s, one request at a time) -----------------------------

LONG = " ".join(f"word{i}" for i in range(30))  # ~2-3 s at 20 tokens/s


@pytest.fixture()
def slow(slow_stack: Stack) -> Iterator[openai.OpenAI]:
    wait_for(lambda: in_flight(slow_stack.settings) == 0, 30, "an idle slow stack")
    with sdk(slow_stack.base_url) as c:
        yield c


def test_background_create_poll_completed(slow: openai.OpenAI, slow_stack: Stack) -> None:
    r = slow.responses.create(model=slow_stack.settings.served_name, input=LONG, background=True)
    assert r.status == "queued" and r.background is True and not r.output
    with pytest.raises(openai.BadRequestError) as err:  # not finished: nothing to continue
        slow.responses.create(
            model=slow_stack.settings.served_name, previous_response_id=r.id, input="next"
        )
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    seen = set()
    deadline = time.monotonic() + 30
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        r = slow.responses.retrieve(r.id)
        seen.add(r.status)
    assert r.status == "completed" and r.output_text == LONG
    assert "in_progress" in seen
    assert r.completed_at is not None and r.completed_at >= r.created_at


def key(event: Any) -> tuple[str, int, str]:
    return event.type, event.sequence_number, getattr(event, "delta", "")


def test_background_stream_resumes_with_starting_after(
    slow: openai.OpenAI, slow_stack: Stack
) -> None:
    model = slow_stack.settings.served_name
    head: list[Any] = []
    stream = slow.responses.create(model=model, input=LONG, background=True, stream=True)
    for event in stream:
        head.append(event)
        if event.type == "response.output_text.delta" and len(head) >= 8:
            break
    stream.close()  # the client goes away mid-stream; the generation goes on
    last = head[-1].sequence_number
    response_id = head[0].response.id
    with slow.responses.stream(response_id=response_id, starting_after=last) as rest:
        tail = list(rest)
        final = rest.get_final_response()
    assert [e.sequence_number for e in tail] == list(range(last + 1, last + 1 + len(tail)))
    text = "".join(e.delta for e in head + tail if e.type == "response.output_text.delta")
    assert text == LONG and final.output_text == LONG
    assert tail[-1].type == "response.completed"
    # A full replay gives the same events the first stream and the resume gave.
    replay = list(slow.responses.retrieve(response_id, stream=True))
    assert [key(e) for e in replay] == [key(e) for e in head + tail]
    assert slow.responses.retrieve(response_id).status == "completed"


def test_background_cancel(slow: openai.OpenAI, slow_stack: Stack) -> None:
    text = " ".join(f"w{i}" for i in range(int(SLOW_RATE) * 20))  # ~20 s: far from done
    r = slow.responses.create(model=slow_stack.settings.served_name, input=text, background=True)
    wait_for(lambda: slow.responses.retrieve(r.id).status == "in_progress", 30, "in_progress")
    started = time.monotonic()
    cancelled = slow.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    # What it had written before the cancel, and no more.
    assert text.startswith(cancelled.output_text) and len(cancelled.output_text) < len(text)
    assert time.monotonic() - started < 5
    assert slow.responses.retrieve(r.id).status == "cancelled"
    wait_for(lambda: in_flight(slow_stack.settings) == 0, 10, "the slot freed")
    # Only background responses can be cancelled; a finished one stays as it was.
    plain = slow.responses.create(model=slow_stack.settings.served_name, input="Hi.")
    with pytest.raises(openai.BadRequestError):
        slow.responses.cancel(plain.id)
