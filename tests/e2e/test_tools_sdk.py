"""Tool calls and structured outputs through the official openai SDK against a real stack
(echo engine: the "model" answers with the last user message, so each test writes the
model's text exactly, tool-call syntax included).

The bundled SmolLM2 template knows no tools, so its model card's parser is Hermes
(``<tool_call>{...}</tool_call>``) and the fallback prompt describes the tools.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from tests.stack import Stack, batcher_process

pytestmark = pytest.mark.e2e

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: Any = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


PARALLEL = call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {})


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=30
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    return stack.settings.served_name


def user(text: str) -> Any:
    return [{"role": "user", "content": text}]


def calls_of(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_tool_calls_plain_and_streamed_agree(client: openai.OpenAI, model: str) -> None:
    plain = client.chat.completions.create(
        model=model, messages=user(PARALLEL), tools=[WEATHER, TIME]
    )
    (choice,) = plain.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    ids = [c.id for c in choice.message.tool_calls or ()]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2

    with client.chat.completions.stream(
        model=model, messages=user(PARALLEL), tools=[WEATHER, TIME]
    ) as stream:
        names = [ev.name for ev in stream if ev.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert names == ["get_weather", "get_time"]
    (streamed,) = final.choices
    assert streamed.finish_reason == "tool_calls"
    assert calls_of(streamed.message) == calls_of(choice.message)
    assert not streamed.message.content  # the role chunk's "" (vLLM sends the same)


def test_malformed_call_is_content(client: openai.OpenAI, model: str) -> None:
    text = '<tool_call>\n{"name": "get_weather" "arguments": {"city": \n</tool_call>'
    r = client.chat.completions.create(model=model, messages=user(text), tools=[WEATHER])
    assert r.choices[0].message.content == text
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_streamed_arguments_grow_and_join_to_the_plain_response(
    client: openai.OpenAI, model: str
) -> None:
    """Issue 42: a call's arguments arrive in more than one delta (the echo engine
    writes a token per step) and join to the arguments of the same call not streamed."""
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius", "days": 3}}\n</tool_call>'
    )
    plain = client.chat.completions.create(model=model, messages=user(text), tools=[WEATHER])
    (call,) = plain.choices[0].message.tool_calls or ()
    fragments: list[str] = []
    for chunk in client.chat.completions.create(
        model=model, messages=user(text), tools=[WEATHER], stream=True
    ):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or ():
                if tc.function is not None and tc.function.arguments:
                    fragments.append(tc.function.arguments)
    assert len(fragments) > 3
    assert "".join(fragments) == call.function.arguments
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius", "days": 3}


def test_two_turn_tool_loop_renders_the_history(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(
        model=model,
        messages=user(call("get_weather", {"city": "Paris"})),
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    message = first.choices[0].message
    (tool_call,) = message.tool_calls or ()
    history: Any = [
        *user(call("get_weather", {"city": "Paris"})),
        message.model_dump(exclude_none=True),  # content null: left out, as SDK users do
        {"role": "tool", "tool_call_id": tool_call.id, "content": "22 C and sunny"},
        {"role": "user", "content": "It is 22 C and sunny in Paris."},
    ]
    second = client.chat.completions.create(model=model, messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == "It is 22 C and sunny in Paris."
    assert second.choices[0].finish_reason == "stop"


class Person(BaseModel):
    name: str
    age: int


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    # The echo engine ignores the constraint; this checks the wire: the strict schema the
    # SDK sends is accepted and its parse() reads the reply.
    r = client.chat.completions.parse(
        model=model, messages=user('{"name": "Ada", "age": 36}'), response_format=Person
    )
    assert r.choices[0].message.parsed == Person(name="Ada", age=36)
    js = client.chat.completions.create(
        model=model, messages=user('{"ok": true}'), response_format={"type": "json_object"}
    )
    assert json.loads(js.choices[0].message.content or "") == {"ok": True}


def test_unenforceable_schema_is_a_400_naming_the_field(client: openai.OpenAI, model: str) -> None:
    schema = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=user("x"),
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        )
    body: Any = info.value.body
    assert body["param"] == "response_format.json_schema.schema"
    assert "uniqueItems" in body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=user("x"), tool_choice="required")
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_deprecated_functions_are_still_501(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=model, messages=user("x"), functions=[{"name": "f", "parameters": {}}]
        )
    assert info.value.status_code == 501


def test_websocket_deltas_carry_the_tool_calls(stack: Stack) -> None:
    from tests.e2e.test_websocket import ChatClient, ws_url

    ws = ChatClient(ws_url(stack))
    try:
        ws.chat("t1", PARALLEL, tools=[WEATHER, TIME])
        ws.wait_done("t1")
    finally:
        ws.close()
    reply = ws.reply("t1")
    assert reply.text() == "" and not reply.errors
    assert reply.finals[0]["finish_reason"] == "tool_calls"
    fragments = [f for d in reply.deltas for f in d.get("tool_calls", ())]
    firsts = [f for f in fragments if "id" in f]
    assert [(f["index"], f["type"], f["function"]["name"]) for f in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    arguments = {
        i: "".join(f["function"]["arguments"] for f in fragments if f["index"] == i) for i in (0, 1)
    }
    assert {i: json.loads(a) for i, a in arguments.items()} == {0: {"city": "Paris"}, 1: {}}


def test_batch_lines_carry_the_tool_calls(
    stack: Stack, client: openai.OpenAI, model: str, tmp_path: Path
) -> None:
    # The batch driver folds a line's events with the same ResponseFold as a plain request.
    line = {
        "custom_id": "tools-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": user(PARALLEL), "tools": [WEATHER, TIME]},
    }
    with batcher_process(stack.settings, tmp_path):
        upload = client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id is not None
    (out,) = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    body = out["response"]["body"]
    assert out["response"]["status_code"] == 200
    message = ChatCompletion.model_validate(body).choices[0].message
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message.content is None
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
