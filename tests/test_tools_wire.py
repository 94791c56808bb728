"""Tools, structured outputs and reasoning on the wire, without servers.

From a request body through ``RecordBuilder`` (prompt, constraint, parser names) and the
streamer's decoders (``RequestDecoder.for_record``) to the exact OpenAI JSON of the framers: the
SSE chunks (``ChunkStream``), the non-streamed body (``ResponseFold``, which batch lines
share) and the WebSocket messages. Streamed chunks are reassembled by the openai SDK's
own stream state and must equal the non-streamed message.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from app.chat_template import PromptBuilder, template_uses_tools
from app.decoder import RequestDecoder
from app.errors import InvalidRequest, ModelError
from app.fold import ResponseFold
from app.intake import RecordBuilder, ResponseShape, shape_of
from app.messages import (
    EngineFinish,
    FinishReason,
    OutputEvent,
    OutputKind,
    TokenDelta,
    ToolCallDelta,
)
from app.model_card import ModelCard, load_model_card
from app.protocol import parse_chat_request
from app.records import OutputConstraint, RequestRecord
from app.toolcalls import TOOL_PARSERS
from app.tools import (
    TOOL_CALL_FORMATS,
    detect_reasoning_parser,
    detect_tool_call_parser,
)
from web.responses import ChunkStream
from web.ws_messages import server_message

WEATHER = {
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
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}


def builder_for(card: ModelCard) -> RecordBuilder:
    return RecordBuilder(
        card,
        PromptBuilder.from_card(card),
        model_name="m",
        request_timeout_s=60,
        clock=lambda: 1_700_000_000.0,
        new_id=lambda: "rid",
    )


@pytest.fixture(scope="module")
def builder(card: ModelCard) -> RecordBuilder:
    return builder_for(card)


def record(builder: RecordBuilder, user: str = "Hi", **fields: Any) -> RequestRecord:
    body = {"model": "m", "messages": [{"role": "user", "content": user}], **fields}
    return builder.chat(parse_chat_request(body))


def prompt_text(builder: RecordBuilder, rec: RequestRecord) -> str:
    return builder.tokenizer.decode(rec.prompts[0], skip_special_tokens=False)


# --- the model card's parsers -----------------------------------------------------------


def test_bundled_template_knows_no_tools_so_its_parser_is_the_fallbacks(card: ModelCard) -> None:
    assert card.chat_template is not None
    assert not template_uses_tools(card.chat_template)
    assert card.tool_call_parser == "hermes"
    assert card.reasoning_parser is None
    assert PromptBuilder.from_card(card).native_tools is False


@pytest.mark.parametrize(
    ("template", "tools", "reasoning"),
    [
        (None, None, None),
        ("{{ messages }}", "hermes", None),
        ("{% for t in tools %}<tool_call>{% endfor %}", "hermes", None),
        ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral", None),
        ("<|python_tag|>{{ tools }}", "llama3_json", None),
        ("{% if m.role == 'ipython' %}{% endif %}", "llama3_json", None),
        ("<think>\n{{ tools }}<tool_call>", "hermes", "think"),
        ("<seed:think>{{ m }}</seed:think><think>", "hermes", "seed_think"),
    ],
)
def test_parsers_are_detected_from_the_template(
    template: str | None, tools: str | None, reasoning: str | None
) -> None:
    assert detect_tool_call_parser(template) == tools
    assert detect_reasoning_parser(template) == reasoning


def test_a_card_that_names_its_parsers_keeps_them(card: ModelCard) -> None:
    data = card.model_dump() | {"tool_call_parser": "mistral", "reasoning_parser": "think"}
    named = ModelCard.model_validate(data)
    assert (named.tool_call_parser, named.reasoning_parser) == ("mistral", "think")
    off = ModelCard.model_validate(card.model_dump() | {"tool_call_parser": None})
    assert off.tool_call_parser is None
    with pytest.raises(ValueError, match="unknown tool_call_parser 'xml'"):
        ModelCard.model_validate(card.model_dump() | {"tool_call_parser": "xml"})


def test_a_prepared_card_with_an_unknown_parser_is_a_model_error(
    card: ModelCard, tmp_path: Path
) -> None:
    data = json.loads(card.to_card_json())
    assert data["tool_call_parser"] == "hermes"  # written by `model prepare`
    data["reasoning_parser"] = "ponder"
    (tmp_path / "tokenrelay.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match="unknown reasoning_parser 'ponder'"):
        load_model_card(tmp_path)


def test_every_parser_has_a_call_format() -> None:
    # The constraint for a forced call is written in the parser's own syntax.
    assert set(TOOL_CALL_FORMATS) == set(TOOL_PARSERS)


# --- rendering --------------------------------------------------------------------------

FALLBACK_PROMPT = (
    "<|im_start|>system\n"
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather in '
    'a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}\n'
    "</tools>\n\n"
    "For each function call, return a json object with the function name and arguments in "
    "exactly this form:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n"
    "Let me look.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n"
    "<tool_response>\n22 C\n</tool_response>\n"
    "<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "sunny"}]},
]


def test_fallback_prompt_for_a_template_without_tools(builder: RecordBuilder) -> None:
    rec = builder.chat(parse_chat_request({"messages": HISTORY, "tools": [WEATHER]}))
    assert prompt_text(builder, rec) == FALLBACK_PROMPT
    # The echo engine repeats the last user turn: the tool results are not one.
    assert builder.tokenizer.decode(rec.echo_ids[0]) == "Weather in Paris?"  # type: ignore[index]


def test_fallback_appends_the_tools_to_a_system_prompt(builder: RecordBuilder) -> None:
    body = {
        "messages": [{"role": "system", "content": "Be brief."}, *HISTORY[:1]],
        "tools": [WEATHER],
    }
    text = prompt_text(builder, builder.chat(parse_chat_request(body)))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert text.count("<|im_start|>system") == 1


def test_history_without_tools_offered_still_renders(builder: RecordBuilder) -> None:
    # An assistant turn with only tool calls has null content: SmolLM2's template could
    # not concatenate it; the fallback writes the calls as its text.
    history = [HISTORY[0], {**HISTORY[1], "content": None}, HISTORY[2]]
    text = prompt_text(builder, builder.chat(parse_chat_request({"messages": history})))
    assert "# Tools" not in text
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
    ) in text


def test_tool_choice_none_leaves_the_tools_out(builder: RecordBuilder) -> None:
    plain = record(builder)
    rec = record(builder, tools=[WEATHER], tool_choice="none")
    assert rec.prompts == plain.prompts
    assert (rec.tools_enabled, rec.tool_parser, rec.sampling.constraint) == (False, None, None)


NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}\n"
    "{% endfor %}"
)


def test_a_template_that_knows_tools_gets_them_as_transformers_passes_them(
    card: ModelCard,
) -> None:
    native = card.model_copy(update={"chat_template": NATIVE_TEMPLATE})
    prompts = PromptBuilder.from_card(native)
    assert prompts.native_tools
    messages = [
        parse_chat_request({"messages": HISTORY}).messages[i].for_template() for i in range(3)
    ]
    messages[1]["content"] = None
    tool = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    text = prompts.render_chat(messages, tools=[tool])
    assert text == (
        f"TOOLS={json.dumps([tool])}\n"
        "[user]Weather in Paris?"  # trim_blocks eats the newline after a block tag
        '[assistant]<tool_call>get_weather{"city": "Paris"}</tool_call>'
        "[tool]22 C(call_1)"
    )


# --- constraints and parser names on the record -----------------------------------------


def test_auto_offers_tools_and_parses_calls_without_a_constraint(builder: RecordBuilder) -> None:
    rec = record(builder, tools=[WEATHER])
    assert (rec.tools_enabled, rec.tool_parser, rec.reasoning_parser) == (True, "hermes", None)
    assert rec.sampling.constraint is None
    assert "# Tools" in prompt_text(builder, rec)


def test_named_tool_choice_forces_one_call_of_that_function(builder: RecordBuilder) -> None:
    rec = record(
        builder,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    constraint = rec.sampling.constraint
    assert constraint is not None
    assert (constraint.kind, constraint.prefix, constraint.suffix) == (
        "tool_call",
        "<tool_call>\n",
        "\n</tool_call>",
    )
    assert json.loads(constraint.json_schema or "") == {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": WEATHER["function"]["parameters"],  # type: ignore[index]
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def test_required_forces_a_call_of_any_function(builder: RecordBuilder) -> None:
    rec = record(builder, tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(rec.sampling.constraint.json_schema or "")  # type: ignore[union-attr]
    assert [s["properties"]["name"]["const"] for s in schema["anyOf"]] == [
        "get_weather",
        "get_time",
    ]


def test_response_formats_become_constraints(builder: RecordBuilder) -> None:
    assert record(builder, response_format={"type": "text"}).sampling.constraint is None
    assert record(
        builder, response_format={"type": "json_object"}
    ).sampling.constraint == OutputConstraint(kind="json_object")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rec = record(
        builder,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "count", "schema": schema, "strict": True},
        },
    )
    assert rec.sampling.constraint == OutputConstraint(
        kind="json_schema", json_schema=json.dumps(schema)
    )


def test_a_forced_call_wins_over_the_response_format(builder: RecordBuilder) -> None:
    rec = record(
        builder,
        tools=[WEATHER],
        tool_choice="required",
        response_format={"type": "json_object"},
    )
    assert rec.sampling.constraint is not None
    assert rec.sampling.constraint.kind == "tool_call"


UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


def test_a_schema_that_cannot_be_enforced_is_a_400_naming_it(builder: RecordBuilder) -> None:
    with pytest.raises(InvalidRequest) as info:
        record(
            builder,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": UNIQUE}},
        )
    assert info.value.param == "response_format.json_schema.schema"
    assert "uniqueItems" in info.value.message
    bad_tool = {"type": "function", "function": {"name": "tag", "parameters": UNIQUE}}
    with pytest.raises(InvalidRequest) as info:
        record(builder, tools=[WEATHER, bad_tool], tool_choice="required")
    assert info.value.param == "tools[1].function.parameters"
    assert "uniqueItems" in info.value.message
    # Not forced, not enforced: an "auto" tool's schema only describes it to the model.
    assert record(builder, tools=[WEATHER, bad_tool]).tools_enabled
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert record(builder, tools=[WEATHER, bad_tool], tool_choice=named).sampling.constraint


def test_a_model_without_a_tool_parser_refuses_tools(card: ModelCard) -> None:
    off = builder_for(card.model_copy(update={"tool_call_parser": None}))
    with pytest.raises(InvalidRequest) as info:
        record(off, tools=[WEATHER])
    assert info.value.param == "tools"
    assert record(off, tools=[WEATHER], tool_choice="none").tools_enabled is False


def test_completions_parse_no_tools_or_reasoning(card: ModelCard) -> None:
    from app.protocol import parse_completion_request

    thinking = builder_for(card.model_copy(update={"reasoning_parser": "think"}))
    rec = thinking.completion(parse_completion_request({"prompt": "Hi"}))
    assert (rec.tool_parser, rec.reasoning_parser, rec.tools_enabled) == (None, None, False)
    assert record(thinking).reasoning_parser == "think"


# --- framing: exact OpenAI JSON ---------------------------------------------------------

CALL_ID = "call_" + "a" * 24


def delta(**fields: Any) -> OutputEvent:
    return OutputEvent(OutputKind.DELTA, 0, **fields)


TOOL_EVENTS = [
    delta(reasoning="The user wants weather."),
    delta(tool_calls=[ToolCallDelta(0, CALL_ID, "get_weather")]),
    delta(tool_calls=[ToolCallDelta(0, arguments='{"city": ')]),
    delta(tool_calls=[ToolCallDelta(0, arguments='"Paris"}')]),
    OutputEvent(OutputKind.FINAL, 0, finish_reason=FinishReason.TOOL_CALLS),
    OutputEvent(
        OutputKind.USAGE,
        usage={
            "prompt_tokens": 5,
            "completion_tokens": 20,
            "total_tokens": 25,
            "completion_tokens_details": {"reasoning_tokens": 6},
        },
    ),
]


def shape(builder: RecordBuilder, **fields: Any) -> Any:
    return shape_of(record(builder, tools=[WEATHER], **fields))


def test_sse_chunks_carry_tool_call_and_reasoning_deltas(builder: RecordBuilder) -> None:
    stream = ChunkStream(shape(builder, stream=True, stream_options={"include_usage": True}))
    chunks = [c.to_dict() for ev in TOOL_EVENTS for c in stream.feed(ev)]
    assert [c["choices"][0]["delta"] if c["choices"] else None for c in chunks] == [
        {"reasoning_content": "The user wants weather."},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": CALL_ID,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
        {},
        None,
    ]
    assert chunks[4]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[5]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 20,
        "total_tokens": 25,
        "completion_tokens_details": {"reasoning_tokens": 6},
    }


def test_the_fold_gives_message_tool_calls_and_null_content(builder: RecordBuilder) -> None:
    fold = ResponseFold.for_shape(shape(builder))
    for ev in TOOL_EVENTS:
        fold.feed(ev)
    body = fold.response().to_dict()
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
        "reasoning_content": "The user wants weather.",
    }
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    ChatCompletion.model_validate(body)  # the SDK's own model reads it


def test_plain_answers_keep_their_shape(builder: RecordBuilder) -> None:
    fold = ResponseFold.for_shape(shape(builder))
    for ev in (
        delta(text="Hello"),
        OutputEvent(OutputKind.FINAL, 0, finish_reason=FinishReason.STOP),
        OutputEvent(OutputKind.USAGE, usage={"prompt_tokens": 1}),
    ):
        fold.feed(ev)
    body = fold.response().to_dict()
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello",
        "refusal": None,
    }
    assert "completion_tokens_details" not in body["usage"]


def test_websocket_delta_messages_carry_tool_calls_and_reasoning() -> None:
    assert server_message("w1", TOOL_EVENTS[0]) == {
        "type": "delta",
        "id": "w1",
        "choice": 0,
        "text": "",
        "reasoning": "The user wants weather.",
    }
    assert server_message("w1", TOOL_EVENTS[1], "5-0") == {
        "type": "delta",
        "id": "w1",
        "choice": 0,
        "text": "",
        "tool_calls": [
            {
                "index": 0,
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ],
        "cursor": "5-0",
    }
    assert server_message("w1", TOOL_EVENTS[2])["tool_calls"] == [
        {"index": 0, "function": {"arguments": '{"city": '}}
    ]


# --- the whole pure path: text -> decoders -> framers -> the SDK ------------------------


def run_pipeline(
    builder: RecordBuilder, rec: RequestRecord, text: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Feed ``text`` one token at a time through the streamer's decoders and frame the
    events both ways: (SSE chunk dicts, non-streamed body)."""
    ids = builder.tokenizer.encode(text, add_special_tokens=False).ids
    decoders = RequestDecoder.for_record(builder.tokenizer, rec)
    events: list[OutputEvent] = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        events += decoders.feed(TokenDelta(0, [token], finish=EngineFinish.EOS if last else None))
    events.append(OutputEvent(OutputKind.USAGE, usage=decoders.usage))
    shape = shape_of(rec)
    stream = ChunkStream(shape)
    chunks = [c.to_dict() for c in stream.opening()]
    chunks += [c.to_dict() for ev in events for c in stream.feed(ev)]
    fold = ResponseFold.for_shape(shape)
    for ev in events:
        fold.feed(ev)
    return chunks, fold.response().to_dict()


def sdk_reassembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The message the openai SDK's stream state builds from the chunks. Its content is
    "" where the plain body's is null: the role chunk (``content: ""``) goes out before
    anyone knows whether the model will call tools, as vLLM's does."""
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    message = state.get_final_completion().choices[0].message
    calls = [
        {
            "id": c.id,
            "type": c.type,
            "function": c.function.model_dump(include={"name", "arguments"}),
        }
        for c in message.tool_calls or ()
    ]
    return {"content": message.content or None, "tool_calls": calls}


def message_of(body: dict[str, Any]) -> dict[str, Any]:
    message = ChatCompletion.model_validate(body).choices[0].message
    calls = [c.model_dump() for c in message.tool_calls or ()]
    return {"content": message.content, "tool_calls": calls}


PARALLEL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)


def test_parallel_calls_from_model_text_streamed_equal_plain(builder: RecordBuilder) -> None:
    rec = record(builder, tools=[WEATHER, TIME])
    chunks, body = run_pipeline(builder, rec, PARALLEL)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert all(c["id"].startswith("call_") for c in calls)
    assert sdk_reassembled(chunks) == message_of(body)
    # No partial tag ever reached a client as content.
    streamed_content = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert streamed_content == ""


def test_malformed_call_is_content_never_an_error(builder: RecordBuilder) -> None:
    # Malformed before its arguments opened (a call that got that far is streamed, and
    # stands: tests/test_decoder_tools.py).
    text = '<tool_call>\n{"name": "get_weather" "arguments": {"city": \n</tool_call>'
    chunks, body = run_pipeline(builder, record(builder, tools=[WEATHER]), text)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text
    assert "tool_calls" not in choice["message"]
    assert sdk_reassembled(chunks) == message_of(body)


def test_tool_syntax_is_text_when_tools_are_off(builder: RecordBuilder) -> None:
    _, body = run_pipeline(builder, record(builder), PARALLEL)
    assert body["choices"][0]["message"]["content"] == PARALLEL


def test_reasoning_then_a_call(builder: RecordBuilder) -> None:
    rec = record(builder, tools=[WEATHER]).model_copy(update={"reasoning_parser": "think"})
    text = "<think>Paris, so get_weather.</think>" + PARALLEL.split("\n<tool_call>")[0]
    chunks, body = run_pipeline(builder, rec, text)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Paris, so get_weather."
    assert message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    streamed_reasoning = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    assert streamed_reasoning == "Paris, so get_weather."
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    assert sdk_reassembled(chunks) == message_of(body)


def test_a_json_response_format_turns_auto_tools_off(builder: RecordBuilder) -> None:
    rec = record(builder, tools=[WEATHER], response_format={"type": "json_object"})
    assert (rec.tools_enabled, rec.tool_parser) == (False, None)
    assert rec.prompts == record(builder).prompts  # not offered either


def test_constrained_outputs_are_not_parsed_for_reasoning(card: ModelCard) -> None:
    thinking = builder_for(card.model_copy(update={"reasoning_parser": "think"}))
    assert record(thinking, response_format={"type": "json_object"}).reasoning_parser is None
    forced = record(thinking, tools=[WEATHER], tool_choice="required")
    assert (forced.reasoning_parser, forced.tool_parser) == (None, "hermes")
    assert record(thinking, tools=[WEATHER]).reasoning_parser == "think"


def test_an_assistant_turn_with_null_content_renders(builder: RecordBuilder) -> None:
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Again"},
    ]
    text = prompt_text(builder, builder.chat(parse_chat_request({"messages": history})))
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nAgain<|im_end|>" in text


_ARGS = st.dictionaries(
    st.text("abcxyz_", min_size=1, max_size=6),
    st.one_of(st.integers(-5, 5), st.text(max_size=8), st.booleans(), st.none()),
    max_size=4,
)


@given(
    calls=st.lists(
        st.tuples(st.sampled_from(["get_weather", "get_time"]), _ARGS), min_size=1, max_size=3
    ),
    cuts=st.lists(st.integers(1, 40), max_size=6),
    text=st.text(max_size=10),
)
@settings(max_examples=60, deadline=None)
def test_any_fragmentation_reassembles_to_the_plain_message(
    calls: list[tuple[str, dict[str, Any]]], cuts: list[int], text: str
) -> None:
    """However the arguments are cut into fragments, the SDK's reassembly of the SSE
    chunks equals the folded message, and the WebSocket fragments concatenate to it."""
    events = [delta(text=text)] if text else []
    for index, (name, arguments) in enumerate(calls):
        events.append(delta(tool_calls=[ToolCallDelta(index, f"call_{index:024x}", name)]))
        body = json.dumps(arguments)
        points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
        events += [
            delta(tool_calls=[ToolCallDelta(index, arguments=body[a:b])])
            for a, b in itertools.pairwise(points)
            if b > a
        ]
    events.append(OutputEvent(OutputKind.FINAL, 0, finish_reason=FinishReason.TOOL_CALLS))
    events.append(OutputEvent(OutputKind.USAGE, usage={"prompt_tokens": 1}))
    shape = ResponseShape(chat=True, response_id="chatcmpl-x", model="m", created=1, num_choices=1)
    stream = ChunkStream(shape)
    chunks = [c.to_dict() for c in stream.opening()]
    chunks += [c.to_dict() for ev in events for c in stream.feed(ev)]
    fold = ResponseFold.for_shape(shape)
    for ev in events:
        fold.feed(ev)
    body = fold.response().to_dict()
    plain = message_of(body)
    assert plain["tool_calls"] == [
        {
            "id": f"call_{i:024x}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)},
        }
        for i, (name, arguments) in enumerate(calls)
    ]
    assert plain["content"] == (text if text.strip() else None)
    assert sdk_reassembled(chunks) == {**plain, "content": text or None}
    fragments = [f for ev in events for f in server_message("w", ev).get("tool_calls", ())]
    for i, (_name, arguments) in enumerate(calls):
        joined = "".join(f["function"]["arguments"] for f in fragments if f["index"] == i)
        assert json.loads(joined) == arguments


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [{"content": "no role"}],
        [{"role": "user", "content": 3}],
    ],
)
@pytest.mark.parametrize("template", [None, NATIVE_TEMPLATE])
def test_bad_messages_with_tools_are_refused_cleanly(
    card: ModelCard, messages: Any, template: str | None
) -> None:
    source = template or card.chat_template
    prompts = PromptBuilder.from_card(card.model_copy(update={"chat_template": source}))
    assert prompts.native_tools is (template is not None)
    with pytest.raises(InvalidRequest):
        prompts.render_chat(messages, tools=[WEATHER])


def test_a_call_without_a_function_is_a_400_from_a_tool_template(card: ModelCard) -> None:
    native = PromptBuilder.from_card(card.model_copy(update={"chat_template": NATIVE_TEMPLATE}))
    with pytest.raises(InvalidRequest, match="cannot render"):
        native.render_chat([{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}])
