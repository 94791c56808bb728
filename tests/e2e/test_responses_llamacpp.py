"""The Responses API on the bundled model (SmolLM2 135M, llamacpp engine): ``text.format``
and a named ``tool_choice`` reach constrained decoding through the translation, so even
this small model's output parses and validates (the echo-engine tests only check the
wire)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.stack import full_stack, isolated_settings

pytest.importorskip("llama_cpp")
pytest.importorskip("workers.engines.llamacpp")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def client(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    # A long lease: a constrained job's first step (its grammar) can outlast the default
    # on a loaded 2-core machine (as in test_tools_llamacpp).
    settings = isolated_settings(
        "redis://unused", models_dir, web_workers=1, web_threads=8, lease_ttl_s=30.0
    )
    with (
        full_stack(settings, tmp_path_factory.mktemp("resp-llama"), engine="llamacpp") as s,
        openai.OpenAI(
            base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0, timeout=180
        ) as c,
    ):
        yield c


class City(BaseModel):
    name: str
    country: str
    population: int


def test_parse_with_text_format_returns_a_validated_instance(client: openai.OpenAI) -> None:
    r = client.responses.parse(
        input="Describe Paris as JSON.",
        text_format=City,
        max_output_tokens=120,
        temperature=0,
    )
    assert r.status == "completed", r
    assert isinstance(r.output_parsed, City)


def test_named_tool_choice_forces_a_valid_call(client: openai.OpenAI) -> None:
    r = client.responses.create(
        input="What's the weather like in Paris today?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
        temperature=0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", r.output
    assert isinstance(json.loads(calls[0].arguments)["city"], str)


def test_a_chained_response_reports_its_reused_prefix(client: openai.OpenAI) -> None:
    """``previous_response_id`` resends the conversation as one prompt; the worker's
    prefix cache finds the previous turn, and Responses' usage says how much."""
    model = client.models.list().data[0].id
    first = client.responses.create(
        model=model,
        instructions="You answer in one short sentence.",
        input="What is snow?",
        max_output_tokens=16,
        temperature=0,
    )
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input="And hail?",
        max_output_tokens=8,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens - 1 <= cached < second.usage.input_tokens
