"""Issue 11's acceptance with the official openai SDK against the bundled model (SmolLM2
135M on the llamacpp engine): constrained decoding makes even this small model's output
parse and validate.

- ``parse(response_format=<pydantic model>)`` returns a parsed instance;
- a two-turn tool loop: ``tool_choice`` named forces a call, the app runs the tool, the
  model answers in text;
- ``json_object`` output parses;
- streamed tool calls reassembled by the SDK equal the non-streamed ones (same seed,
  temperature 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.stack import Stack, full_stack, isolated_settings

pytest.importorskip("llama_cpp")
pytest.importorskip("workers.engines.llamacpp")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


@pytest.fixture(scope="module")
def llama_stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A long lease: on a loaded 2-core machine a constrained job's first step (building
    # its grammar) can outlast the default 5 s, and a lost-worker resume is the subject
    # of the fault suites, not of this one.
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        web_workers=1,
        web_threads=8,
        worker_slots=4,
        lease_ttl_s=30.0,
    )
    with full_stack(settings, tmp_path_factory.mktemp("tools-llama"), engine="llamacpp") as s:
        yield s


@pytest.fixture(scope="module")
def client(llama_stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{llama_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=180
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(llama_stack: Stack) -> str:
    return llama_stack.settings.served_name


class City(BaseModel):
    name: str
    country: str
    population: int


def test_parse_returns_a_validated_instance(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City)


def test_json_object_output_parses(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_two_turn_tool_loop(client: openai.OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (tool_call,) = choice.message.tool_calls or ()
    assert tool_call.function.name == "get_weather"
    arguments = json.loads(tool_call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)

    # The app runs the tool and hands the result back; the model answers in text.
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": "22 C and sunny"},
    ]
    second = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


def test_streamed_tool_calls_equal_plain_ones(client: openai.OpenAI, model: str) -> None:
    request: Any = {
        "model": model,
        "messages": [{"role": "user", "content": "Weather in Tokyo and in Lima?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 60,
        "temperature": 0,
        "seed": 7,
    }
    plain = client.chat.completions.create(**request).choices[0]
    with client.chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert plain.finish_reason == streamed.finish_reason == "tool_calls"

    def calls(message: Any) -> list[tuple[str, str]]:
        return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]

    assert calls(plain.message) and calls(streamed.message) == calls(plain.message)


def test_anthropic_sdk_over_the_bundled_model(llama_stack: Stack) -> None:
    """Issue 42: the anthropic SDK against the real model: a text answer, and a tool
    use forced by ``tool_choice`` (the grammar makes SmolLM2 write a valid call), then
    the tool's result answered in text."""
    import anthropic

    model = llama_stack.settings.served_name
    tool = {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    with anthropic.Anthropic(base_url=llama_stack.base_url, api_key="x", max_retries=0) as c:
        hello = c.messages.create(
            model=model,
            max_tokens=12,
            extra_body={"temperature": 0},  # a field this SDK no longer has
            messages=[{"role": "user", "content": "Say hello."}],
        )
        assert hello.content[0].type == "text" and hello.content[0].text
        assert hello.stop_reason in ("end_turn", "max_tokens")
        question = {"role": "user", "content": "What is the weather in Paris?"}
        forced: Any = {
            "model": model,
            "max_tokens": 64,
            "extra_body": {"temperature": 0},  # a field this SDK no longer has
            "tools": [tool],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [question],
        }
        first = c.messages.create(**forced)
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "get_weather" and isinstance(use.input, dict)
        assert isinstance(use.input.get("city"), str) and first.stop_reason == "tool_use"
        with c.messages.stream(**forced) as stream:
            streamed = stream.get_final_message()

        def blocks(message: Any) -> list[dict[str, Any]]:
            return [b.model_dump(exclude={"id"}) for b in message.content]  # ids are new

        assert blocks(streamed) == blocks(first)
        answer = c.messages.create(
            model=model,
            max_tokens=16,
            extra_body={"temperature": 0},  # a field this SDK no longer has
            tools=[tool],  # type: ignore[list-item]
            messages=[
                question,  # type: ignore[list-item]
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}],
                },
            ],
        )
        assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
