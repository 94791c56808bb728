"""The OpenAI protocol models: request validation, conversions, response shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from app.errors import InvalidRequest, error_body
from app.messages import FinishReason, LogprobEntry
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    validation_error_to_invalid_request,
)
from app.records import SamplingParams, StopConditions
from app.response_models import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobToken,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    ModelList,
    ModelObject,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)

MESSAGES = [{"role": "user", "content": "Hello"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_chat_request({"model": "m", "messages": MESSAGES, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return parse_completion_request({"model": "m", "prompt": "Hi", **fields})


def chat_error(body: dict[str, Any], **limits: int) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(body, **limits)
    return info.value


def chat_field_error(**fields: Any) -> InvalidRequest:
    return chat_error({"model": "m", "messages": MESSAGES, **fields})


def completion_error(**fields: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request({"model": "m", "prompt": "Hi", **fields})
    return info.value


# --- requests: the basics ---------------------------------------------------------------


def test_minimal_chat_request_defaults() -> None:
    req = parse_chat_request({"messages": MESSAGES})
    assert req.model is None
    assert req.n == 1
    assert req.stop == []
    assert req.stream is False
    assert req.include_usage is False
    assert req.max_new_tokens is None
    assert req.uses_deprecated_functions is False


def test_full_chat_request_is_accepted() -> None:
    req = chat(
        max_tokens=50,
        n=2,
        stop=["\n", "END"],
        stop_token_ids=[7],
        include_stop_str_in_output=True,
        min_tokens=3,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=1.0,
        frequency_penalty=-1.0,
        repetition_penalty=1.1,
        logit_bias={"50256": -100},
        seed=42,
        logprobs=True,
        top_logprobs=5,
        stream=True,
        stream_options={"include_usage": True},
        user="u1",
        ignore_eos=True,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
    )
    assert req.include_usage is True
    assert req.logit_bias == {50256: -100.0}
    assert req.max_new_tokens == 50


@pytest.mark.parametrize("field", ["foo", "tool_calls_x", "best_of"])
def test_unknown_field_is_rejected_by_name(field: str) -> None:
    err = chat_field_error(**{field: 1})
    assert err.message == f"Unrecognized request argument supplied: {field}"
    assert err.param == field
    assert err.status == 400


def test_unknown_nested_field_names_its_path() -> None:
    err = chat_error({"messages": [{"role": "user", "content": "x", "foo": 1}]})
    assert err.message == "Unrecognized request argument supplied: messages[0].foo"
    assert err.param == "messages[0].foo"
    err = chat_field_error(stream=True, stream_options={"continuous": True})
    assert err.param == "stream_options.continuous"


def test_every_unknown_field_is_named_in_one_message() -> None:
    err = chat_field_error(foo=1, bar=2, temperature=0.5)
    assert err.message == "Unrecognized request arguments supplied: foo, bar"
    assert (err.param, err.status) == ("foo", 400)
    err = completion_error(messages=MESSAGES, zap=True)
    assert err.message == "Unrecognized request arguments supplied: messages, zap"


def test_unknown_fields_are_named_before_other_errors() -> None:
    err = chat_error(
        {
            "messages": [
                {"role": "user", "content": "x", "foo": 1},
                {"role": "user", "content": [{"type": "text", "text": "y", "a": 1, "b": 2}]},
            ],
            "temperature": 9,
            "stream": True,
            "stream_options": {"continuous": True},
            "zap": 1,
        }
    )
    assert err.message.startswith("Unrecognized request arguments supplied: ")
    named = err.message.removeprefix("Unrecognized request arguments supplied: ").split(", ")
    assert sorted(named) == sorted(
        [
            "messages[0].foo",
            "messages[1].content[0].a",
            "messages[1].content[0].b",
            "stream_options.continuous",
            "zap",
        ]
    )
    assert err.param == named[0]


def test_unknown_keys_of_every_content_part_are_named() -> None:
    parts = [{"type": "text", "text": "a", "x": 1}, {"type": "text", "text": "b", "y": 2}]
    err = chat_error({"messages": [{"role": "user", "content": parts}]})
    assert err.message == (
        "Unrecognized request arguments supplied: messages[0].content[0].x, "
        "messages[0].content[1].y"
    )
    assert err.param == "messages[0].content[0].x"


def test_skip_special_tokens_is_accepted_on_both_endpoints() -> None:
    assert chat().skip_special_tokens is True  # vLLM's default
    assert chat(skip_special_tokens=False).skip_special_tokens is False
    assert completion(skip_special_tokens=False).skip_special_tokens is False
    assert completion().skip_special_tokens is True
    assert chat_field_error(skip_special_tokens="maybe").param == "skip_special_tokens"


def test_body_must_be_an_object() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request([1, 2])
    assert info.value.param is None
    assert "JSON object" in info.value.message


# --- messages ---------------------------------------------------------------------------


def test_messages_required_and_non_empty() -> None:
    err = chat_error({"model": "m"})
    assert (err.param, err.message) == ("messages", "Missing required parameter: 'messages'.")
    err = chat_error({"model": "m", "messages": []})
    assert err.param == "messages"
    assert "non-empty" in err.message
    assert chat_error({"messages": "hello"}).param == "messages"


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_message_roles(role: str) -> None:
    message = {"role": role, "content": "x"}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    req = parse_chat_request({"messages": [message]})
    assert req.messages[0].role == role


def test_unknown_role_is_rejected() -> None:
    err = chat_error({"messages": [{"role": "bot", "content": "x"}]})
    assert err.param == "messages[0].role"
    assert "'bot'" in err.message


def test_message_content_forms() -> None:
    req = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "Be brief.", "name": "sys"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            ]
        }
    )
    assert [m.text for m in req.messages] == ["Be brief.", "a\nb", "", "42"]
    assert req.messages[0].name == "sys"
    assert req.messages[3].tool_call_id == "call_1"


@pytest.mark.parametrize(
    ("message", "param", "needle"),
    [
        ({"role": "user"}, "messages[0].content", "Missing required parameter"),
        ({"role": "user", "content": None}, "messages[0].content", "Missing"),
        ({"role": "user", "content": 5}, "messages[0].content", "string or a list"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages[0].content[0].type",
            "only 'text'",
        ),
        (
            {"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]},
            "messages[0].content[0].extra",
            "Unrecognized request argument supplied: messages[0].content[0].extra",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text", "text"),
        ({"role": "user", "content": ["a"]}, "messages[0].content[0]", "object"),
        ({"content": "x"}, "messages[0].role", "Missing required parameter"),
    ],
)
def test_bad_messages(message: dict[str, Any], param: str, needle: str) -> None:
    err = chat_error({"messages": [message]})
    assert err.param == param
    assert needle in err.message


def test_deprecated_functions_are_accepted_and_flagged() -> None:
    assert chat(functions=[{"name": "f", "parameters": {}}]).uses_deprecated_functions
    assert chat(function_call="auto").uses_deprecated_functions
    req = parse_chat_request({"messages": [{"role": "function", "name": "f", "content": "1"}]})
    assert req.uses_deprecated_functions


# --- tools and response formats ---------------------------------------------------------


def test_tool_calling_none_forms_are_accepted() -> None:
    chat(tools=None, tool_choice=None)
    chat(tools=[], tool_choice="none")
    chat(tool_choice="auto")
    chat(response_format=None)
    chat(response_format={"type": "text"})


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "not in 'tools'",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
        # Wrong shapes in our words, not pydantic's union members (``literal[...]``).
        ({"tool_choice": {"type": "function"}}, "tool_choice", "must name the function"),
        (
            {"tool_choice": {"type": "function", "function": {"name": 3}}},
            "tool_choice",
            "must name the function",
        ),
        (
            {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto"}}},
            "tool_choice",
            "'allowed_tools' is not supported",
        ),
        ({"tool_choice": {"type": "custom"}}, "tool_choice", "use 'none', 'auto'"),
        ({"tool_choice": 7}, "tool_choice", "use 'none', 'auto'"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "Missing required parameter",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.name",
            "Missing required parameter",
        ),
        (
            {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "only allowed with type 'json_schema'",
        ),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "Missing"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'retrieval'"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "'a b'",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
            "dictionary",
        ),
        ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls", "boolean"),
    ],
)
def test_bad_tool_fields_are_named(fields: dict[str, Any], param: str, needle: str) -> None:
    err = chat_field_error(**fields)
    assert err.param == param
    assert needle in err.message
    assert "literal[" not in err.message and "ToolChoice" not in err.message  # ours, not pydantic's


# --- numeric ranges ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "good", "bad"),
    [
        ("temperature", [0, 0.7, 2], [-0.1, 2.01, "hot", float("nan"), float("inf")]),
        ("top_p", [0.01, 1], [0, -1, 1.5]),
        ("top_k", [-1, 0, 50], [-2]),
        ("min_p", [0, 0.5, 1], [-0.1, 1.1]),
        ("presence_penalty", [-2, 0, 2], [-2.1, 2.1]),
        ("frequency_penalty", [-2, 0, 2], [-2.1, 2.1]),
        ("repetition_penalty", [0.5, 1, 2], [0, 2.5]),
        ("max_tokens", [1, 4096], [0, -5]),
        ("max_completion_tokens", [1], [0]),
        ("min_tokens", [0, 3], [-1]),
        ("n", [1, 16], [0, 17]),
        ("seed", [0, -1, 2**63 - 1], [2**63, "abc"]),
    ],
)
def test_ranges(field: str, good: list[Any], bad: list[Any]) -> None:
    for value in good:
        assert getattr(chat(**{field: value}), field) == value
    for value in bad:
        err = chat_field_error(**{field: value})
        assert err.param == field, value
        assert field in err.message


def test_null_sampling_fields_mean_default() -> None:
    req = chat(temperature=None, top_p=None, seed=None, stop=None, logit_bias=None)
    assert req.sampling_params() == SamplingParams()


def test_n_limit_comes_from_the_caller() -> None:
    body = {"messages": MESSAGES, "n": 100}
    assert parse_chat_request(body, max_n=128).n == 100
    err = chat_error(body, max_n=64)
    assert err.param == "n"
    assert "64" in err.message


def test_model_validate_without_context_uses_default_limits() -> None:
    assert ChatCompletionRequest.model_validate({"messages": MESSAGES, "n": 16}).n == 16
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "n": 17})


def test_max_tokens_and_max_completion_tokens() -> None:
    assert chat(max_completion_tokens=5).max_new_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=5).max_new_tokens == 5
    err = chat_field_error(max_tokens=5, max_completion_tokens=6)
    assert err.param == "max_completion_tokens"


def test_min_tokens_may_not_exceed_max_tokens() -> None:
    assert chat(min_tokens=5, max_tokens=5).min_tokens == 5
    assert chat_field_error(min_tokens=6, max_tokens=5).param == "min_tokens"
    assert chat_field_error(min_tokens=6, max_completion_tokens=5).param == "min_tokens"


# --- stop -------------------------------------------------------------------------------


def test_stop_forms() -> None:
    assert chat(stop="END").stop == ["END"]
    assert chat(stop=["a", "b"]).stop == ["a", "b"]
    assert chat(stop=None).stop == []
    assert chat(stop="").stop == []
    assert chat(stop=["", "a", "a"]).stop == ["a"]


@pytest.mark.parametrize("bad", [5, [1], ["a", None], {"a": 1}])
def test_stop_type_errors(bad: Any) -> None:
    err = chat_field_error(stop=bad)
    assert err.param == "stop"
    assert "string" in err.message


def test_stop_count_limit_comes_from_the_caller() -> None:
    stops = [f"s{i}" for i in range(5)]
    body = {"messages": MESSAGES, "stop": stops}
    assert parse_chat_request(body, max_stop_sequences=5).stop == stops
    err = chat_error(body, max_stop_sequences=4)
    assert err.param == "stop"
    assert "4" in err.message
    assert chat_error({"messages": MESSAGES, "stop": [f"{i}" for i in range(17)]}).param == "stop"


def test_stop_token_ids() -> None:
    assert chat(stop_token_ids=[1, 2]).stop_token_ids == [1, 2]
    assert chat(stop_token_ids=None).stop_token_ids == []
    for bad in ([-1], ["1"], [True], 3):
        assert chat_field_error(stop_token_ids=bad).param == "stop_token_ids"


# --- logit_bias, logprobs, stream_options ------------------------------------------------


def test_logit_bias_keys_become_token_ids() -> None:
    req = chat(logit_bias={"0": 100, "50256": -100, "7": 0.5})
    assert req.logit_bias == {0: 100.0, 50256: -100.0, 7: 0.5}
    assert req.sampling_params().logit_bias == {0: 100.0, 50256: -100.0, 7: 0.5}


@pytest.mark.parametrize(
    "bias",
    [{"abc": 1}, {"-1": 1}, {"1.5": 1}, {"1": 101}, {"1": -100.5}, {"1": "x"}, {"1": True}, [1]],
)
def test_bad_logit_bias(bias: Any) -> None:
    err = chat_field_error(logit_bias=bias)
    assert err.param == "logit_bias"
    assert "logit_bias" in err.message


def test_top_logprobs_needs_logprobs() -> None:
    assert chat(logprobs=True, top_logprobs=20).top_logprobs == 20
    assert chat(logprobs=True, top_logprobs=0).top_logprobs == 0
    assert chat_field_error(top_logprobs=2).param == "top_logprobs"
    assert chat_field_error(logprobs=False, top_logprobs=2).param == "top_logprobs"
    assert chat_field_error(logprobs=True, top_logprobs=21).param == "top_logprobs"
    assert chat_field_error(logprobs=True, top_logprobs=-1).param == "top_logprobs"


def test_stream_options_need_stream() -> None:
    for fields in ({}, {"stream": False}, {"stream": None}):
        err = chat_field_error(stream_options={"include_usage": True}, **fields)
        assert err.param == "stream_options"
        assert err.message == (
            "The 'stream_options' parameter is only allowed when 'stream' is enabled."
        )
    assert chat(stream=True, stream_options={"include_usage": False}).include_usage is False
    assert chat(stream=True, stream_options=None).include_usage is False
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True


# --- completions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("Hi", ["Hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt: Any, prompts: list[Any]) -> None:
    assert parse_completion_request({"prompt": prompt}).prompts == prompts


@pytest.mark.parametrize(
    "prompt", ["", [], [""], [1, "a"], [[1], []], [-1], [[True]], 5, None, {"a": 1}]
)
def test_bad_completion_prompts(prompt: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request({"prompt": prompt})
    assert info.value.param == "prompt"


def test_completion_prompt_required() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request({"model": "m"})
    assert info.value.message == "Missing required parameter: 'prompt'."


def test_completion_defaults_follow_openai() -> None:
    req = completion()
    assert req.max_tokens == 16
    assert req.logprobs is None
    assert req.stop_conditions(eos_token_ids=[2], default_max_tokens=100).max_tokens == 16


def test_completion_echo_suffix_best_of() -> None:
    assert completion(echo=False, suffix=None, best_of=None).echo is False
    assert completion(suffix="").suffix == ""
    assert completion(n=3, best_of=3).best_of == 3
    assert completion(echo=True).echo is True  # the prompt's text starts each choice
    assert completion(suffix="}").suffix == "}"  # fill-in-the-middle, where the model can
    err = completion_error(echo=True, logprobs=1)
    assert err.param == "echo" and "not supported" in err.message
    assert completion_error(echo=True, suffix="}").param == "echo"
    assert completion_error(n=1, best_of=2).param == "best_of"


def test_completion_logprobs_limit() -> None:
    assert completion(logprobs=0).logprobs == 0
    assert completion(logprobs=20).logprobs == 20
    assert completion_error(logprobs=21).param == "logprobs"
    assert completion_error(logprobs=-1).param == "logprobs"
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request({"prompt": "x", "logprobs": 6}, max_logprobs=5)
    assert info.value.param == "logprobs"


def test_completion_rejects_chat_fields() -> None:
    err = completion_error(messages=MESSAGES)
    assert err.message == "Unrecognized request argument supplied: messages"


def test_completion_stream_options_need_stream() -> None:
    assert completion_error(stream_options={"include_usage": True}).param == "stream_options"
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage


# --- ValidationError -> InvalidRequest --------------------------------------------------


def test_validation_error_conversion() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "temperature": 9})
    err = validation_error_to_invalid_request(info.value)
    assert isinstance(err, InvalidRequest)
    assert err.param == "temperature"
    assert err.message == (
        "Invalid value for 'temperature': Input should be less than or equal to 2 (got 9)."
    )
    status, body = error_body(err)
    assert status == 400
    assert body == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }


def test_parse_errors_chain_the_validation_error() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request({"messages": MESSAGES, "n": "many"})
    assert isinstance(info.value.__cause__, ValidationError)


def test_long_inputs_are_not_echoed() -> None:
    err = chat_field_error(temperature="x" * 1000)
    assert "xxxxx" not in err.message


# --- conversions ------------------------------------------------------------------------


def test_defaults_map_to_neutral_sampling_params() -> None:
    params = chat().sampling_params()
    assert params == SamplingParams()
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.repetition_penalty == 1.0
    assert params.logprobs is None
    assert completion().sampling_params() == SamplingParams()


def test_sampling_params_carry_the_request() -> None:
    params = chat(
        temperature=0,
        top_p=0.5,
        top_k=-1,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.2,
        seed=7,
    ).sampling_params()
    assert params == SamplingParams(
        temperature=0.0,
        top_p=0.5,
        top_k=0,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.2,
        seed=7,
    )
    assert chat(top_k=40).sampling_params().top_k == 40


def test_logprobs_conversion() -> None:
    assert chat(logprobs=False).sampling_params().logprobs is None
    assert chat(logprobs=True).sampling_params().logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).sampling_params().logprobs == 3
    assert completion(logprobs=0).sampling_params().logprobs == 0
    assert completion(logprobs=5).sampling_params().logprobs == 5


def test_stop_conditions() -> None:
    req = chat(
        stop="END",
        stop_token_ids=[9],
        min_tokens=2,
        include_stop_str_in_output=True,
        ignore_eos=True,
    )
    assert req.stop_conditions(eos_token_ids=[2, 3], default_max_tokens=100) == (
        StopConditions(
            max_tokens=100,
            min_tokens=2,
            stop=("END",),
            stop_token_ids=(9,),
            eos_token_ids=(2, 3),
            include_stop_str_in_output=True,
            ignore_eos=True,
        )
    )


def test_stop_conditions_max_tokens_precedence() -> None:
    def limit(req: ChatCompletionRequest | CompletionRequest) -> int | None:
        return req.stop_conditions(eos_token_ids=(), default_max_tokens=99).max_tokens

    assert limit(chat()) == 99
    assert limit(chat(max_tokens=5)) == 5
    assert limit(chat(max_completion_tokens=7)) == 7
    assert limit(completion(max_tokens=None)) == 99
    assert chat().stop_conditions(eos_token_ids=(), default_max_tokens=None).max_tokens is None


@given(
    stops=st.lists(st.text(max_size=5), max_size=16),
    ids=st.lists(st.integers(min_value=0, max_value=10**6), max_size=8),
)
def test_stop_round_trip(stops: list[str], ids: list[int]) -> None:
    conds = chat(stop=stops, stop_token_ids=ids).stop_conditions(
        eos_token_ids=[0], default_max_tokens=None
    )
    assert conds.stop == tuple(dict.fromkeys(s for s in stops if s))
    assert conds.stop_token_ids == tuple(ids)


# --- responses --------------------------------------------------------------------------


def test_chat_completion_response_dump() -> None:
    resp = ChatCompletionResponse(
        id="chatcmpl-123",
        created=1677652288,
        model="gpt-4o-mini",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatResponseMessage(content="Hello there!"),
                finish_reason=FinishReason.STOP,
            )
        ],
        usage=Usage(prompt_tokens=9, completion_tokens=12, total_tokens=21),
    )
    expected = {
        "id": "chatcmpl-123",
        "object": "chat.completion",
        "created": 1677652288,
        "model": "gpt-4o-mini",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there!", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
    }
    assert resp.to_dict() == expected
    assert json.loads(resp.to_json()) == expected
    assert json.loads(json.dumps(resp.model_dump())) == expected


def test_chat_response_with_logprobs_and_cached_tokens() -> None:
    entries = [LogprobEntry(15339, "Hello", -0.31, [72, 101, 108, 108, 111], [("Hello", -0.31)])]
    resp = ChatCompletionResponse(
        id="chatcmpl-1",
        created=1,
        model="m",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatResponseMessage(content="Hello"),
                logprobs=ChatChoiceLogprobs.from_entries(entries),
                finish_reason="stop",
                stop_reason="END",
            )
        ],
        usage=Usage(
            prompt_tokens=4,
            completion_tokens=1,
            total_tokens=5,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=2),
        ),
    )
    body = resp.to_dict()
    assert body["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "Hello",
                "logprob": -0.31,
                "bytes": [72, 101, 108, 108, 111],
                "top_logprobs": [
                    {"token": "Hello", "logprob": -0.31, "bytes": [72, 101, 108, 108, 111]}
                ],
            }
        ],
        "refusal": None,
    }
    assert body["choices"][0]["stop_reason"] == "END"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_generated_ids_and_created() -> None:
    resp = ChatCompletionResponse(model="m", choices=[], usage=Usage())
    assert resp.id.startswith("chatcmpl-")
    assert resp.created > 1_600_000_000
    assert CompletionResponse(model="m", choices=[], usage=Usage()).id.startswith("cmpl-")
    assert resp.id != ChatCompletionResponse(model="m", choices=[], usage=Usage()).id


def test_chat_chunks_dump() -> None:
    head = {"id": "chatcmpl-123", "created": 1694268190, "model": "m"}
    role = ChatCompletionChunk(
        **head,
        choices=[ChatCompletionChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))],
    )
    delta = ChatCompletionChunk(
        **head, choices=[ChatCompletionChunkChoice(index=0, delta=ChatDelta(content="Hi"))]
    )
    final = ChatCompletionChunk(
        **head, choices=[ChatCompletionChunkChoice(index=0, finish_reason="length")]
    )
    usage = ChatCompletionChunk(
        **head, usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    )
    base = {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1694268190}
    base["model"] = "m"

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }

    # As OpenAI sends them: "refusal": null on the role chunk, content-only deltas after.
    assert role.to_dict() == {
        **base,
        "choices": [choice({"role": "assistant", "content": "", "refusal": None})],
    }
    assert delta.to_dict() == {**base, "choices": [choice({"content": "Hi"})]}
    assert final.to_dict() == {**base, "choices": [choice({}, "length")]}
    assert usage.to_dict() == {
        **base,
        "choices": [],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    assert json.loads(delta.to_json()) == delta.to_dict()


def test_completion_response_dump() -> None:
    resp = CompletionResponse(
        id="cmpl-uqkvlQyYK7bGYrRHQ0eXlWi7",
        created=1589478378,
        model="m",
        choices=[
            CompletionChoice(
                index=0,
                text="\n\nThis is indeed a test",
                finish_reason="length",
                logprobs=CompletionLogprobs.from_entries(
                    [
                        LogprobEntry(1, "\n\n", -0.5, [10, 10], [("\n\n", -0.5), ("\n", -1.5)]),
                        LogprobEntry(2, "This", -0.25, [84, 104, 105, 115], [("This", -0.25)]),
                    ],
                    offset=3,
                ),
            )
        ],
        usage=Usage(prompt_tokens=5, completion_tokens=7, total_tokens=12),
    )
    assert resp.to_dict() == {
        "id": "cmpl-uqkvlQyYK7bGYrRHQ0eXlWi7",
        "object": "text_completion",
        "created": 1589478378,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "\n\nThis is indeed a test",
                "logprobs": {
                    "tokens": ["\n\n", "This"],
                    "token_logprobs": [-0.5, -0.25],
                    "top_logprobs": [{"\n\n": -0.5, "\n": -1.5}, {"This": -0.25}],
                    "text_offset": [3, 5],
                },
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
    }


def test_completion_chunk_dump() -> None:
    chunk = CompletionChunk(
        id="cmpl-1", created=2, model="m", choices=[CompletionChoice(index=1, text="a")]
    )
    assert chunk.to_dict() == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 2,
        "model": "m",
        "choices": [
            {"index": 1, "text": "a", "logprobs": None, "finish_reason": None, "stop_reason": None}
        ],
    }
    with_usage = CompletionChunk(id="cmpl-1", created=2, model="m", usage=Usage(total_tokens=1))
    assert with_usage.to_dict()["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 1,
    }


def test_models_and_errors_dump() -> None:
    models = ModelList(
        data=[ModelObject(id="SmolLM2", created=1, owned_by="tokenrelay", max_model_len=8192)]
    )
    assert models.to_dict() == {
        "object": "list",
        "data": [
            {
                "id": "SmolLM2",
                "object": "model",
                "created": 1,
                "owned_by": "tokenrelay",
                "max_model_len": 8192,
            }
        ],
    }
    _, body = error_body(InvalidRequest("bad", param="n"))
    assert ErrorResponse.model_validate(body).to_dict() == body
    assert ErrorResponse(error=ErrorBody(message="m", type="t")).to_dict() == {
        "error": {"message": "m", "type": "t", "param": None, "code": None}
    }


def test_response_models_reject_typos() -> None:
    with pytest.raises(ValidationError):
        Usage(prompt_token=1)  # type: ignore[call-arg]


# --- the official SDK parses our dumps --------------------------------------------------


def test_openai_sdk_parses_our_dumps() -> None:
    openai = pytest.importorskip("openai")
    from openai.types import Completion, Model
    from openai.types.chat import ChatCompletion
    from openai.types.chat import ChatCompletionChunk as SdkChunk

    lp = ChatChoiceLogprobs(
        content=[
            ChatLogprobToken(
                token="Hi",
                logprob=-0.1,
                bytes=[72, 105],
                top_logprobs=[TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105])],
            )
        ]
    )
    resp = ChatCompletionResponse(
        model="m",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatResponseMessage(content="Hi"),
                logprobs=lp,
                finish_reason="stop",
            )
        ],
        usage=Usage(
            prompt_tokens=3,
            completion_tokens=1,
            total_tokens=4,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=1),
        ),
    )
    parsed = ChatCompletion.model_validate(resp.to_dict())
    assert parsed.choices[0].message.content == "Hi"
    assert parsed.choices[0].logprobs is not None
    assert parsed.usage is not None and parsed.usage.total_tokens == 4

    head = {"id": "chatcmpl-1", "created": 1, "model": "m"}
    chunks = [
        ChatCompletionChunk(
            **head,
            choices=[
                ChatCompletionChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))
            ],
        ),
        ChatCompletionChunk(
            **head,
            choices=[
                ChatCompletionChunkChoice(index=0, delta=ChatDelta(content="Hi"), logprobs=lp)
            ],
        ),
        ChatCompletionChunk(
            **head, choices=[ChatCompletionChunkChoice(index=0, finish_reason="stop")]
        ),
        ChatCompletionChunk(**head, usage=Usage(prompt_tokens=1, total_tokens=1)),
    ]
    texts = [SdkChunk.model_validate(c.to_dict()) for c in chunks]
    assert texts[1].choices[0].delta.content == "Hi"
    assert texts[2].choices[0].finish_reason == "stop"
    assert texts[3].usage is not None and texts[3].choices == []

    completion_resp = CompletionResponse(
        model="m",
        choices=[
            CompletionChoice(
                index=0,
                text="abc",
                finish_reason="length",
                logprobs=CompletionLogprobs.from_entries(
                    [LogprobEntry(1, "abc", -1.0, [97, 98, 99], [("abc", -1.0)])], offset=0
                ),
            )
        ],
        usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )
    parsed_completion = Completion.model_validate(completion_resp.to_dict())
    assert parsed_completion.choices[0].text == "abc"
    assert parsed_completion.choices[0].logprobs is not None
    chunk = CompletionChunk(id="cmpl-1", created=1, model="m", choices=[])
    assert Completion.model_validate(chunk.to_dict()).choices == []
    assert Model.model_validate(ModelObject(id="m").to_dict()).owned_by == "tokenrelay"
    assert openai is not None


VLLM_EXTENSIONS = {
    "stop_token_ids",
    "include_stop_str_in_output",
    "min_tokens",
    "ignore_eos",
    "top_k",
    "min_p",
    "repetition_penalty",
    "skip_special_tokens",
    "cache_salt",
    "priority",
    "chat_template_kwargs",
}


def test_field_names_match_the_openai_sdk() -> None:
    """Every field that is not a vLLM extension is spelled as the SDK sends it."""
    pytest.importorskip("openai")
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import completion_create_params as chat_params

    sdk_chat = set(chat_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    sdk_completion = set(completion_params.CompletionCreateParamsBase.__annotations__)
    sdk_completion |= {"stream"}
    assert set(ChatCompletionRequest.model_fields) - VLLM_EXTENSIONS <= sdk_chat
    assert set(CompletionRequest.model_fields) - VLLM_EXTENSIONS <= sdk_completion
