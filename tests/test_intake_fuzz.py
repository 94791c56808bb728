# ruff: noqa: E501 (the bodies below read best one message or option a line)
"""Hostile bodies at the intake: whatever a client sends, ``Intake.prepare`` either
prepares it or raises a ``TokenRelayError`` below 500 (a clear 4xx); never another
exception (a 500 and a traceback).

Found by mutating valid bodies of every endpoint (below, kept as a test): JSON text
inside a body (a tool call's ``arguments``) was read with ``json.loads``, so an
escaped lone surrogate in it reached the tokenizer (``TypeError``) and a deeply
nested one raised ``RecursionError``; a Messages ``tools`` entry that is not an
object raised ``AttributeError``; ``chat_template_kwargs`` named like a Python
parameter (``self``, ``now``) raised ``TypeError``.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from app.chat_template import PromptBuilder
from app.errors import InvalidRequest, TokenRelayError
from app.intake import Endpoint, Intake, Limits, RecordBuilder
from app.lenient_json import MAX_DEPTH, loads_embedded
from app.model_card import ModelCard
from app.tokenize_api import tokenize

LONE = "\\ud800"  # a JSON escape of a lone surrogate, as a client's text would carry it


@pytest.fixture(scope="module")
def intake(card: ModelCard) -> Intake:
    builder = RecordBuilder(
        card, PromptBuilder.from_card(card), model_name="m", request_timeout_s=60, clock=time.time
    )
    return Intake(builder, Limits())


def chat_with_call(arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
    }


def test_json_text_in_a_body_is_read_with_the_body_s_guarantees() -> None:
    assert loads_embedded('{"city": "' + LONE + '"}') == {"city": "\ufffd"}
    assert loads_embedded('{"a": [1]}') == {"a": [1]}
    for bad in ("not json", "", "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "[" * 100_000):
        with pytest.raises(ValueError):
            loads_embedded(bad)


def test_a_lone_surrogate_in_a_tool_call_s_arguments_is_repaired(intake: Intake) -> None:
    body = json.dumps(chat_with_call('{"city": "' + LONE + '"}')).encode()
    prepared = intake.prepare(Endpoint.CHAT, body)
    assert prepared.record.prompts[0]  # rendered and tokenized
    responses = {
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": "' + LONE + '"}'},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
        ]
    }  # fmt: skip
    assert intake.prepare(Endpoint.RESPONSES, json.dumps(responses).encode()).record.prompts[0]


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000, 100_000])
def test_deeply_nested_tool_call_arguments_are_kept_as_text(intake: Intake, depth: int) -> None:
    body = chat_with_call('{"a": ' + "[" * depth + "]" * depth + "}")
    try:
        intake.prepare(Endpoint.CHAT, json.dumps(body).encode())
    except TokenRelayError as exc:  # a prompt past the context: a 400, never a 500
        assert exc.status == 400, exc


def test_a_messages_tool_that_is_not_an_object_is_a_400(intake: Intake) -> None:
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [1]}
    with pytest.raises(InvalidRequest) as refused:
        intake.prepare(Endpoint.MESSAGES, json.dumps(body).encode())
    assert refused.value.param == "tools.0"


@pytest.mark.parametrize("name", ["self", "now", "source", "variables", "strftime_now"])
def test_template_kwargs_named_like_a_parameter_are_template_variables(
    intake: Intake, name: str
) -> None:
    """``chat_template_kwargs`` reach the template as variables, whatever their names:
    once, ``{"self": 1}`` or ``{"now": 1}`` bound a Python parameter (a 500)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {name: 1}}
    assert intake.prepare(Endpoint.CHAT, json.dumps(body).encode()).record.prompts[0]
    assert tokenize(body, intake.builder.prompts)["count"] > 0


# -- mutations of valid bodies ---------------------------------------------------------------

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "d",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
BODIES: dict[Endpoint, dict[str, Any]] = {
    Endpoint.CHAT: {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [TOOL], "tool_choice": "auto", "max_tokens": 16, "temperature": 0.5,
        "top_p": 0.9, "n": 2, "stop": ["\n\n"], "logprobs": True, "top_logprobs": 2,
        "seed": 3, "logit_bias": {"42": 5}, "stream": True,
        "stream_options": {"include_usage": True}, "presence_penalty": 0.1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
    },
    Endpoint.COMPLETIONS: {
        "model": "m", "prompt": ["a b c", [1, 2, 3]], "max_tokens": 8, "echo": True,
        "logprobs": 2, "stop": "x", "best_of": 1, "n": 1, "seed": 1,
    },
    Endpoint.RESPONSES: {
        "model": "m",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "instructions": "short", "max_output_tokens": 16, "store": False,
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    },
    Endpoint.MESSAGES: {
        "model": "m", "max_tokens": 16, "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
        ],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}, "stop_sequences": ["x"], "top_k": 5, "stream": True,
    },
}  # fmt: skip
ODD: list[Any] = [
    None, True, False, 0, -1, 2**31, 2**63, 10**30, -(10**30), 1.5, -0.0, 1e308,
    float("inf"), float("nan"), "", "x", "\x00", "\ud800", "a" * 5000, [], {}, [None], [[]],
    [{}], {"": None}, {"type": None}, {"type": "text"}, {"type": "function"}, ["x", 1], "[]",
    "{}", "null", '{"a": "' + LONE + '"}', '"' + LONE + '"', "[" * 3000,
    '{"a":' + "[" * 200 + "]" * 200 + "}",
]  # fmt: skip


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict | list):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            yield from _paths(child, (*path, key))


def mutated(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """``body`` with one to three changes: a value replaced by an odd one, dropped,
    repeated in its list, or an odd key added beside it."""
    body = copy.deepcopy(body)
    for _ in range(rng.choice((1, 1, 2, 3))):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break  # everything deleted
        path = rng.choice(paths)
        parent: Any = body
        for key in path[:-1]:
            parent = parent[key]
        key, roll = path[-1], rng.random()
        if roll < 0.6:
            parent[key] = copy.deepcopy(rng.choice(ODD))
        elif roll < 0.75:
            del parent[key]
        elif roll < 0.85 and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        elif isinstance(parent, dict):
            name = rng.choice(("type", "role", "content", "name", "id", "x"))
            parent[name] = copy.deepcopy(rng.choice(ODD))
    return body


@pytest.mark.parametrize("seed", range(4))
def test_mutated_bodies_are_prepared_or_refused_with_a_4xx(intake: Intake, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        endpoint = rng.choice(list(BODIES))
        raw = json.dumps(mutated(BODIES[endpoint], rng)).encode()  # as a client sends it
        try:
            intake.prepare(endpoint, raw)
        except TokenRelayError as exc:
            assert exc.status < 500, (endpoint, raw[:300], exc)
