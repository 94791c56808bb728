"""Anthropic's Messages API, its pure half (app.messages_api): the request translated
to a chat body, every field of the anthropic SDK's create-request accepted, and the
events a run's output makes (issue 42)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from app.chat_template import PromptBuilder
from app.errors import InvalidRequest, NotFound, QueueFull, ServiceUnavailable
from app.intake import Endpoint, Intake, Limits, RecordBuilder
from app.messages import FinishReason, OutputEvent, OutputKind, ToolCallDelta
from app.messages_api import (
    MESSAGE_FIELDS,
    MessageFeed,
    anthropic_error,
    messages_param,
    to_chat_body,
)
from app.model_card import ModelCard

pytestmark = pytest.mark.unit


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_every_field_of_the_sdk_s_request_is_known() -> None:
    from anthropic.types import message_create_params

    sdk = set(message_create_params.MessageCreateParamsBase.__annotations__) | {"stream"}
    assert sdk <= MESSAGE_FIELDS
    with pytest.raises(InvalidRequest) as err:
        to_chat_body(body(colour="red"))
    assert err.value.param == "colour"


def test_a_conversation_with_tools_becomes_chat_messages() -> None:
    chat = to_chat_body(
        body(
            system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            tools=[{"name": "w", "description": "weather", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["END"],
            metadata={"user_id": "u1"},
            thinking={"type": "disabled"},
            temperature=0.5,
            stream=True,
        )
    )
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "w", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "w", "parameters": {"type": "object"}, "description": "weather"},
        }
    ]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert chat["stop"] == ["END"] and chat["user"] == "u1" and chat["temperature"] == 0.5
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["stream_options"] == {"include_usage": True}


def test_output_config_is_effort_and_a_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat_body(
        body(output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
    )
    assert chat["reasoning_effort"] == "low"
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
        ({"tool_choice": {"type": "some"}}, "tool_choice"),
        ({"temperature": 1.5}, "temperature"),
        ({"thinking": {"type": "always"}}, "thinking"),
    ],
)
def test_bad_requests_name_the_field(bad: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        to_chat_body(body(**bad))
    assert err.value.param == param


@pytest.fixture(scope="module")
def intake(card: ModelCard) -> Intake:
    builder = RecordBuilder(
        card, PromptBuilder.from_card(card), model_name="m", request_timeout_s=60, clock=time.time
    )
    return Intake(builder, Limits())


TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(
    ("bad", "param", "says"),
    [
        ({"tool_choice": {"type": "any"}}, "tool_choice", "type 'any'"),
        ({"tool_choice": {"type": "tool", "name": "w"}}, "tool_choice", "type 'tool'"),
        (
            {"tool_choice": {"type": "tool", "name": "w"}, "tools": [TOOL]},
            "tool_choice.name",
            "'w'",
        ),
        ({"tools": [{**TOOL, "name": "bad name"}]}, "tools.0.name", "'tools.0.name'"),
        (
            {"tools": [{**TOOL, "input_schema": "x"}]},
            "tools.0.input_schema",
            "'tools.0.input_schema'",
        ),
        ({"output_config": {"effort": "bogus"}}, "output_config.effort", "'output_config.effort'"),
    ],
)
def test_intake_errors_name_anthropic_s_fields(
    intake: Intake, bad: dict[str, Any], param: str, says: str
) -> None:
    """What the client sent, never the chat body it became ('required', 'function',
    'reasoning_effort'), in the message (all Anthropic's error shows) and in ``param``;
    the same for a count of the prompt."""
    for prepare in (
        lambda b: intake.prepare(Endpoint.MESSAGES, b),
        intake.message_tokens,
    ):
        with pytest.raises(InvalidRequest) as err:
            prepare(body(**bad))
        assert err.value.param == param and says in err.value.message
        chat_words = ("required", "function", "reasoning_effort", "[0]")
        assert not any(word in err.value.message for word in chat_words), err.value.message


def test_chat_params_are_renamed() -> None:
    assert messages_param("tools[2].function.parameters") == "tools.2.input_schema"
    assert messages_param("tools[2]") == "tools.2"
    assert messages_param("response_format.json_schema.schema") == "output_config.format.schema"
    assert messages_param("stop[1]") == "stop_sequences.1"
    assert messages_param("messages[3].content") == "messages"
    assert messages_param("max_tokens") == "max_tokens" and messages_param(None) is None


def test_errors_take_anthropic_s_shape_and_status() -> None:
    assert anthropic_error(InvalidRequest("bad", param="x")) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}},
    )
    assert anthropic_error(NotFound("no"))[1]["error"]["type"] == "not_found_error"
    assert anthropic_error(QueueFull("full", retry_after=1))[1]["error"]["type"] == (
        "rate_limit_error"
    )
    status, error = anthropic_error(ServiceUnavailable("busy", retry_after=1))
    assert (status, error["error"]["type"]) == (529, "overloaded_error")
    assert anthropic_error(RuntimeError("secret"))[1]["error"]["type"] == "api_error"


def ev(kind: OutputKind, **kw: Any) -> OutputEvent:
    return OutputEvent(kind, choice=None if kind is OutputKind.USAGE else 0, **kw)


def run_feed(*events: OutputEvent) -> tuple[MessageFeed, list[dict[str, Any]]]:
    feed = MessageFeed(message_id="msg_1", model="m", input_tokens=7)
    out = feed.opening()
    for e in events:
        out += feed.feed(e)
    return feed, out


def test_thinking_then_text_then_a_tool_use() -> None:
    feed, out = run_feed(
        ev(OutputKind.DELTA, reasoning="Let me "),
        ev(OutputKind.DELTA, reasoning="think."),
        ev(OutputKind.DELTA, text="Calling."),
        ev(OutputKind.DELTA, tool_calls=[ToolCallDelta(0, "call_1", "w", "")]),
        ev(OutputKind.DELTA, tool_calls=[ToolCallDelta(0, None, None, '{"city"')]),
        ev(OutputKind.DELTA, tool_calls=[ToolCallDelta(0, None, None, ': "Oslo"}')]),
        ev(OutputKind.FINAL, finish_reason=FinishReason.TOOL_CALLS),
        ev(OutputKind.USAGE, usage={"prompt_tokens": 7, "completion_tokens": 9}),
    )
    kinds = [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in out]
    assert kinds == [
        ("message_start", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2]["usage"] == {"output_tokens": 9}
    message = feed.message()
    assert message["content"] == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "call_1", "name": "w", "input": {"city": "Oslo"}},
    ]
    assert message["usage"]["input_tokens"] == 7 and message["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("final", "reason", "sequence"),
    [
        ({"finish_reason": FinishReason.STOP}, "end_turn", None),
        ({"finish_reason": FinishReason.STOP, "stop_reason": "END"}, "stop_sequence", "END"),
        ({"finish_reason": FinishReason.LENGTH}, "max_tokens", None),
    ],
)
def test_stop_reasons(final: dict[str, Any], reason: str, sequence: str | None) -> None:
    feed, _ = run_feed(
        ev(OutputKind.DELTA, text="x"),
        ev(OutputKind.FINAL, **final),
        ev(OutputKind.USAGE, usage={"completion_tokens": 1}),
    )
    assert (feed.message()["stop_reason"], feed.message()["stop_sequence"]) == (reason, sequence)


def test_a_failure_ends_the_stream_with_an_error_event() -> None:
    feed, out = run_feed(
        ev(OutputKind.DELTA, text="partial"),
        ev(OutputKind.FINAL, finish_reason=FinishReason.ERROR, error="worker lost", code=503),
    )
    assert feed.done and feed.error is not None
    assert out[-2] == {"type": "content_block_stop", "index": 0}
    assert out[-1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "worker lost"},
    }


@pytest.mark.parametrize(
    ("pieces", "final", "want"),
    [
        (['{"city": "', "Par"], {"stop_reason": "Paris"}, {}),
        (
            ['{"city": "Paris", ', '"unit": "c'],
            {"finish_reason": FinishReason.LENGTH},
            {"city": "Paris"},
        ),
        (['{"days": [1, 2', ", 3"], {"finish_reason": FinishReason.LENGTH}, {"days": [1, 2, 3]}),
        (['{"city": "Oslo"}'], {"finish_reason": FinishReason.TOOL_CALLS}, {"city": "Oslo"}),
        (["not json"], {"finish_reason": FinishReason.TOOL_CALLS}, {}),
        (["[1, 2]"], {"finish_reason": FinishReason.TOOL_CALLS}, {}),
    ],
)
def test_a_tool_use_cut_short_has_the_input_a_streamed_client_builds(
    pieces: list[str], final: dict[str, Any], want: dict[str, Any]
) -> None:
    """A call cut by a stop sequence or ``max_tokens`` is not whole JSON: its input is
    the members written in full, as the anthropic SDK's stream helper parses the same
    deltas (never an invented ``_raw`` key the tool did not declare)."""
    from anthropic.lib.streaming._messages import accumulate_event

    feed, out = run_feed(
        ev(OutputKind.DELTA, tool_calls=[ToolCallDelta(0, "call_1", "w", "")]),
        *(ev(OutputKind.DELTA, tool_calls=[ToolCallDelta(0, None, None, p)]) for p in pieces),
        ev(OutputKind.FINAL, **final),
        ev(OutputKind.USAGE, usage={"prompt_tokens": 7, "completion_tokens": 9}),
    )
    (block,) = feed.message()["content"]
    assert block["input"] == want
    if pieces != ["not json"]:  # the SDK raises on text that is no JSON at all
        snapshot: Any = None
        bufs: dict[int, bytes] = {}
        for event in out:
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
        streamed = snapshot.content[0].input
        assert block["input"] == (streamed if isinstance(streamed, dict) else {})
