"""The Responses API's pure half: request translation (app.responses_api) and the event
framer (app.responses_events), checked against the openai SDK's own types."""

from __future__ import annotations

import time
from typing import Any, get_args

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from app.chat_template import PromptBuilder
from app.errors import InvalidRequest
from app.intake import Endpoint, Intake, Limits, RecordBuilder
from app.messages import FinishReason, OutputEvent, OutputKind, ToolCallDelta
from app.model_card import ModelCard
from app.responses_api import (
    ResponseSkeleton,
    chat_messages,
    parse_responses_request,
    request_id_of,
    response_id_of,
    responses_param,
    to_chat_body,
    with_ids,
)
from app.responses_events import ResponseEvents, ResponsesFold
from app.settings import Settings
from tests.stack import make_record

# The SDK's event union, by its ``type`` literal (its discriminator is the SDK's own).
EVENT_TYPES: dict[str, Any] = {
    get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in get_args(get_args(ResponseStreamEvent)[0])
}


@pytest.fixture(scope="module")
def intake(card: ModelCard) -> Intake:
    builder = RecordBuilder(
        card, PromptBuilder.from_card(card), model_name="m", request_timeout_s=60, clock=time.time
    )
    return Intake(builder, Limits())


def chat_of(body: dict[str, Any], context: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    req = parse_responses_request(body)
    return to_chat_body(req, (context or []) + req.input_items)


def test_string_input_and_instructions() -> None:
    chat = chat_of(
        {
            "model": "m",
            "input": "Hi",
            "instructions": "Be brief.",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "stream": True,
        }
    )
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ],
        "stream": True,
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
    }


def test_items_with_function_calls_become_one_assistant_turn() -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "W?"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
    ]
    assert chat_of({"input": items})["messages"] == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "W?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": '{"a": 1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]


def test_assistant_text_then_a_call_is_one_turn() -> None:
    items = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Ok"}],
        },
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ]
    (turn,) = chat_messages(parse_responses_request({"input": items}).input_items)
    assert turn["content"] == "Ok" and turn["tool_calls"][0]["id"] == "c"


def test_tools_tool_choice_and_formats() -> None:
    tool = {"type": "function", "name": "get", "parameters": {"type": "object"}}
    chat = chat_of(
        {
            "input": "x",
            "tools": [tool],
            "tool_choice": {"type": "function", "name": "get"},
            "text": {"format": {"type": "json_schema", "name": "P", "schema": {"type": "object"}}},
        }
    )
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "P", "schema": {"type": "object"}},
    }
    assert chat_of({"input": "x", "text": {"format": {"type": "json_object"}}})[
        "response_format"
    ] == {"type": "json_object"}
    assert "response_format" not in chat_of({"input": "x", "text": {"format": {"type": "text"}}})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "x", "conversation": 3}, "conversation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": "x", "truncation": "some"}, "truncation"),
        ({"input": "x", "background": True, "store": False}, "store"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({}, "input"),
    ],
)
def test_refused_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_responses_request(body)
    assert err.value.param == param
    assert err.value.status == 400


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice", "'tool_choice' 'required'"),
        ({"tool_choice": "required", "tools": []}, "tool_choice", "'tools'"),
        ({"tool_choice": {"type": "function"}, "tools": [FUNCTION]}, "tool_choice.name", ""),
        ({"tool_choice": {"type": "function", "name": 3}, "tools": [FUNCTION]}, "tool_choice", ""),
    ],
)
def test_a_tool_choice_that_cannot_be_kept_is_refused(
    body: dict[str, Any], param: str, says: str
) -> None:
    """A call forced with nothing to call is a 400, as chat and OpenAI answer (it was
    accepted and dropped); a function choice without a name says so."""
    with pytest.raises(InvalidRequest) as err:
        parse_responses_request({"input": "x", **body})
    assert err.value.param.startswith(param) and says in err.value.message
    assert "None" not in err.value.message


def test_intake_errors_name_the_responses_field_in_param_and_message(intake: Intake) -> None:
    bad = {**FUNCTION, "name": "bad name"}
    with pytest.raises(InvalidRequest) as err:
        intake.prepare(Endpoint.RESPONSES, {"input": "x", "tools": [bad]})
    assert err.value.param == "tools[0].name"
    assert "'tools[0].name'" in err.value.message and "function" not in err.value.message


def test_harmless_hints_are_accepted() -> None:
    body = {
        "input": "x",
        "reasoning": None,
        "prompt_cache_key": "k",
        "safety_identifier": "u1",
        "service_tier": "auto",
        "stream_options": {"include_obfuscation": False},
        "include": ["reasoning.encrypted_content"],
        "truncation": "auto",
        "top_logprobs": 2,
    }
    assert chat_of(body)["messages"] == [{"role": "user", "content": "x"}]


def test_reasoning_effort_and_max_tool_calls_reach_the_chat_body() -> None:
    body = chat_of({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}})
    assert body["reasoning_effort"] == "low"
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    one = chat_of({"input": "x", "tools": tools, "max_tool_calls": 1})
    assert one["parallel_tool_calls"] is False
    assert chat_of({"input": "x", "tools": tools})["parallel_tool_calls"] is True


def test_the_response_object_echoes_the_request_s_fields() -> None:
    """As OpenAI's Response object: what the request said, its defaults where it said
    nothing (``truncation`` was always "disabled", the rest were missing)."""
    asked = {
        "truncation": "auto",
        "reasoning": {"effort": "low", "summary": "auto"},
        "top_logprobs": 3,
        "max_tool_calls": 3,
    }
    req = parse_responses_request({"input": "x", **asked})
    base = ResponseSkeleton("resp_r1", 1700000000, "m", req).base()
    assert {k: base[k] for k in asked} == asked
    default = ResponseSkeleton("resp_r1", 0, "m", parse_responses_request({"input": "x"})).base()
    assert {k: default[k] for k in asked} == {
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        "top_logprobs": 0,
        "max_tool_calls": None,
    }
    for obj in (base, default):
        echoed = Response.model_validate({**obj, "status": "completed"})
        assert echoed.truncation == obj["truncation"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": "3"}, "top_logprobs"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
    ],
)
def test_echoed_fields_are_checked(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_responses_request({"input": "x", **body})
    assert err.value.param == param


@pytest.mark.parametrize("name", ["conversation", "prompt"])
def test_references_to_objects_stored_at_openai_are_not_found(name: str) -> None:
    from app.errors import NotFound

    with pytest.raises(NotFound) as err:
        parse_responses_request({"input": "x", name: {"id": "conv_1"}})
    assert err.value.param == name and "conv_1" in err.value.message


def test_chat_params_are_renamed() -> None:
    assert responses_param("messages") == "input"
    assert responses_param("messages[2].content") == "input[2].content"
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("tools[0].function.parameters") == "tools[0].parameters"


def test_ids() -> None:
    assert request_id_of(response_id_of("abc123")) == "abc123"
    assert request_id_of("chatcmpl-1") is None and request_id_of("resp_a b") is None
    counter = iter(range(10))
    items = with_ids(
        parse_responses_request({"input": "x"}).input_items, lambda: str(next(counter))
    )
    assert items[0]["id"] == "msg_0"


# -- events ---------------------------------------------------------------------------------


def framer(body: dict[str, Any] | None = None, *, queued: bool = False) -> ResponseEvents:
    req = parse_responses_request(body or {"input": "x", "metadata": {"k": "v"}})
    base = ResponseSkeleton("resp_r1", 1700000000, "m", req).base()
    return ResponseEvents(base, "r1", queued=queued)


def delta(text: str = "", **kw: Any) -> OutputEvent:
    return OutputEvent(OutputKind.DELTA, choice=0, text=text, **kw)


def final(reason: FinishReason = FinishReason.STOP, **kw: Any) -> OutputEvent:
    return OutputEvent(OutputKind.FINAL, choice=0, finish_reason=reason, **kw)


USAGE = OutputEvent(
    OutputKind.USAGE,
    usage={
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "completion_tokens_details": {"reasoning_tokens": 1},
        "timings": {"e2e_s": 2.4},
    },
)


def run(events: ResponseEvents, outputs: list[OutputEvent]) -> list[dict[str, Any]]:
    out = events.opening()
    for ev in outputs:
        out += events.feed(ev)
    for i, ev in enumerate(out):
        assert ev["sequence_number"] == i
        EVENT_TYPES[ev["type"]].model_validate(ev, strict=False)  # the SDK's own type
    return out


def test_text_events_in_order_and_the_final_object() -> None:
    events = framer(queued=True)
    out = run(events, [delta("Hel"), delta("lo"), final(), USAGE])
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert out[0]["response"]["status"] == "queued"
    assert out[1]["response"]["status"] == "in_progress"
    assert out[6]["text"] == "Hello"
    final_object = Response.model_validate(out[-1]["response"])
    assert final_object.output_text == "Hello" and final_object.status == "completed"
    assert final_object.metadata == {"k": "v"}
    assert final_object.completed_at == 1700000002
    assert final_object.usage is not None
    assert final_object.usage.output_tokens_details.reasoning_tokens == 1
    assert final_object.usage.input_tokens == 5 and final_object.usage.total_tokens == 8
    assert events.done and events.response == out[-1]["response"]
    assert events.feed(delta("late")) == []


def test_max_tokens_is_incomplete() -> None:
    out = run(framer(), [delta("ab"), final(FinishReason.LENGTH), USAGE])
    last = Response.model_validate(out[-1]["response"])
    assert out[-1]["type"] == "response.incomplete" and last.status == "incomplete"
    assert last.incomplete_details is not None
    assert last.incomplete_details.reason == "max_output_tokens"
    assert last.output[0].status == "incomplete"


def test_text_then_tool_calls() -> None:
    calls = [
        ToolCallDelta(0, id="call_a", name="get", arguments='{"city": '),
    ]
    out = run(
        framer(),
        [
            delta("Let me see."),
            delta(tool_calls=calls),
            delta(tool_calls=[ToolCallDelta(0, arguments='"Paris"}')]),
            delta(tool_calls=[ToolCallDelta(1, id="call_b", name="now", arguments="{}")]),
            final(FinishReason.TOOL_CALLS),
            USAGE,
        ],
    )
    types = [e["type"] for e in out]
    assert types[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    r = Response.model_validate(out[-1]["response"])
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    first = r.output[1]
    assert first.type == "function_call" and first.call_id == "call_a"
    assert first.arguments == '{"city": "Paris"}' and first.name == "get"
    assert len({o.id for o in r.output}) == 3


def test_reasoning_is_its_own_item() -> None:
    out = run(framer(), [delta(reasoning="hmm"), delta("Yes"), final(), USAGE])
    r = Response.model_validate(out[-1]["response"])
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert "response.reasoning_text.delta" in [e["type"] for e in out]


def test_request_error_fails_the_response() -> None:
    err = OutputEvent(OutputKind.ERROR, error="deadline", code=504)
    out = run(framer(), [delta("a"), final(FinishReason.ERROR, error="deadline", code=504), err])
    assert [e["type"] for e in out][-2:] == ["error", "response.failed"]
    r = Response.model_validate(out[-1]["response"])
    assert r.status == "failed" and r.error is not None and r.error.code == "server_error"
    assert r.error.message == "deadline"


def test_cancelled_ends_incomplete_with_status_cancelled() -> None:
    out = run(framer(), [delta("a"), final(FinishReason.CANCELLED), USAGE])
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["status"] == "cancelled"


def test_replay_gives_the_same_events() -> None:
    outputs = [delta("one "), delta("two"), final(), USAGE]
    assert run(framer(), outputs) == run(framer(), outputs)


def test_other_choices_are_ignored() -> None:
    events = framer()
    events.opening()
    assert events.feed(OutputEvent(OutputKind.DELTA, choice=1, text="x")) == []


def test_the_batch_fold_answers_like_the_chat_fold() -> None:
    record = make_record(Settings(), [[1, 2]])
    req = parse_responses_request({"input": "x"})
    ok = ResponsesFold(req, record)
    for ev in (delta("Hi"), final(), USAGE):
        ok.feed(ev)
    assert ok.done and ok.failure is None and not ok.aborted
    body = Response.model_validate(ok.response().to_dict())
    assert body.id == "resp_" + record.request_id and body.output_text == "Hi"
    failed = ResponsesFold(req, record)
    failed.feed(final(FinishReason.ERROR, error="bad prompt", code=400))
    failed.feed(OutputEvent(OutputKind.ERROR, error="bad prompt", code=400))
    assert failed.done and failed.failure is not None and failed.failure.status == 400
    cancelled = ResponsesFold(req, record)
    for ev in (delta("a"), final(FinishReason.CANCELLED), USAGE):
        cancelled.feed(ev)
    assert cancelled.aborted


def test_the_object_in_progress_holds_the_text_so_far() -> None:
    events = framer()
    out = events.opening() + events.feed(delta("Hel")) + events.feed(delta("lo"))
    added = next(e for e in out if e["type"] == "response.output_item.added")
    assert added["item"]["content"] == []  # content_part.added brings the part
    snapshot = Response.model_validate(events.response)
    assert snapshot.status == "in_progress" and snapshot.output_text == "Hello"
    assert snapshot.output[0].status == "in_progress"


# A valid value of every field of the openai SDK's Responses create-request (issue 42).
RESPONSES_FIELDS: dict[str, Any] = {
    "input": "x",
    "model": "m",
    "access_programs": {},
    "background": False,
    "background_options": {},
    "context_management": [],
    "conversation": None,  # any id is a 404 here: test_references_to_objects_...
    "image": {},
    "include": ["message.output_text.logprobs"],
    "instructions": "Be brief.",
    "max_output_tokens": 16,
    "max_tool_calls": 2,
    "metadata": {"team": "a"},
    "moderation": None,
    "parallel_tool_calls": True,
    "previous_response_id": None,  # needs a stored response: tests/e2e
    "prompt": None,  # as conversation
    "prompt_cache_key": "k",
    "prompt_cache_options": {},
    "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low", "summary": "auto"},
    "safety_identifier": "u-1",
    "service_tier": "auto",
    "store": True,
    "stream": False,
    "stream_options": {"include_obfuscation": False},
    "temperature": 0.5,
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "tool_choice": "auto",
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "top_logprobs": 2,
    "top_p": 0.9,
    "truncation": "auto",
    "user": "u-1",
}


def test_every_field_of_the_sdk_s_responses_request_is_accepted() -> None:
    from openai.types.responses import response_create_params

    sdk = set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert sdk == set(RESPONSES_FIELDS)
    for name, value in RESPONSES_FIELDS.items():
        parse_responses_request({"input": "x", name: value})
    chat = chat_of(RESPONSES_FIELDS)
    assert chat["reasoning_effort"] == "low" and chat["max_tokens"] == 16
