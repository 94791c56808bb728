"""Every field of OpenAI's published create-request schemas is accepted (issue 42):
the openai SDK's own request types list them, so a field the SDK gains and this server
does not know fails here first. Each is sent with a valid value, alone and all at once;
those with a meaning here are checked for it (``service_tier`` echoed, ``echo``,
``parallel_tool_calls: false``, ``reasoning_effort``); a field in no schema is still the
one 400 naming it."""

from __future__ import annotations

from typing import Any

import pytest
from flask.testing import FlaskClient

from tests.web.conftest import RequestIds, ScriptedOutput, delta, final, usage
from tests.web.test_openai_routes import chat, error_of, sse_payloads

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

# A valid value of every field of the SDK's chat completions create-request.
CHAT_FIELDS: dict[str, Any] = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": None,  # the default model (filled in per test)
    "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.1,
    "logit_bias": {"42": 1.0},
    "logprobs": True,
    "max_completion_tokens": 8,
    "max_tokens": 8,
    "metadata": {"team": "a"},
    "modalities": ["text"],
    "moderation": None,
    "n": 1,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "hello"},
    "presence_penalty": 0.1,
    "prompt_cache_key": "user-1",
    "prompt_cache_options": {},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "response_format": {"type": "text"},
    "safety_identifier": "u-1",
    "seed": 7,
    "service_tier": "auto",
    "stop": ["\n\n"],
    "store": False,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
    "temperature": 0.5,
    "tool_choice": "auto",
    "tools": TOOLS,
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "u-1",
    "verbosity": "low",
    "web_search_options": {},
    "functions": None,
    "function_call": None,
    "stream": True,
}

# ... and of its (legacy) completions create-request.
COMPLETION_FIELDS: dict[str, Any] = {
    "prompt": "Once upon a time",
    "model": None,
    "best_of": 1,
    "echo": True,
    "frequency_penalty": 0.1,
    "logit_bias": {"42": 1.0},
    "logprobs": None,  # with echo: see test_echo_with_logprobs_is_refused_clearly
    "max_tokens": 8,
    "n": 1,
    "presence_penalty": 0.1,
    "seed": 7,
    "stop": "\n",
    "stream_options": {"include_usage": True},
    "suffix": None,  # fill-in-the-middle needs a model with FIM tokens (test_fim.py)
    "temperature": 0.5,
    "top_p": 0.9,
    "user": "u-1",
    "stream": True,
}


def sdk_fields(module: str, name: str) -> set[str]:
    import importlib

    return set(getattr(importlib.import_module(module), name).__annotations__) | {"stream"}


def test_the_tables_cover_every_field_the_sdk_sends() -> None:
    chat_sdk = sdk_fields(
        "openai.types.chat.completion_create_params", "CompletionCreateParamsBase"
    )
    assert chat_sdk == set(CHAT_FIELDS)
    text_sdk = sdk_fields("openai.types.completion_create_params", "CompletionCreateParamsBase")
    assert text_sdk == set(COMPLETION_FIELDS)


def script_ok(scripted: ScriptedOutput, rid: str, text: str = "Hello") -> None:
    scripted.write(rid, delta(0, text), final(0, stop="\n"), usage(5, 1))


@pytest.mark.parametrize("field", sorted(CHAT_FIELDS))
def test_each_chat_field_alone_is_accepted(
    field: str, client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    body = chat(max_tokens=8)
    body[field] = CHAT_FIELDS[field]
    if field in ("top_logprobs",):
        body["logprobs"] = True
    if field in ("stream_options",):
        body["stream"] = True
    if field in ("tool_choice", "parallel_tool_calls"):
        body["tools"] = TOOLS
    if field == "max_completion_tokens":
        del body["max_tokens"]
    script_ok(scripted, ids.peek())
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)


def test_every_chat_field_at_once_is_accepted(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    body = {k: v for k, v in CHAT_FIELDS.items() if v is not None}
    rid = ids.peek()
    script_ok(scripted, rid)
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    chunks = sse_payloads(resp.get_data(as_text=True))
    # One tier here: a request that names one is told "default", on every chunk.
    assert {c.get("service_tier") for c in chunks} == {"default"}


@pytest.mark.parametrize("field", sorted(COMPLETION_FIELDS))
def test_each_completion_field_alone_is_accepted(
    field: str, client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    body: dict[str, Any] = {"prompt": "Once", field: COMPLETION_FIELDS[field]}
    if field == "stream_options":
        body["stream"] = True
    script_ok(scripted, ids.peek())
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)


def test_unknown_fields_are_still_one_400_naming_them(client: FlaskClient) -> None:
    resp = client.post("/v1/chat/completions", json=chat(store=True, colour="red", size=2))
    assert resp.status_code == 400
    err = error_of(resp)
    assert "colour" in err["message"] and "size" in err["message"] and "store" not in err["message"]


def test_service_tier_is_echoed_as_default(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    script_ok(scripted, ids.peek())
    body = client.post("/v1/chat/completions", json=chat(service_tier="flex")).get_json()
    assert body["service_tier"] == "default"
    script_ok(scripted, ids.peek())
    assert "service_tier" not in client.post("/v1/chat/completions", json=chat()).get_json()


def test_echo_puts_the_prompt_before_the_completion(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput
) -> None:
    script_ok(scripted, ids.peek(), " there")
    body = client.post("/v1/completions", json={"prompt": "Hi", "echo": True}).get_json()
    assert body["choices"][0]["text"] == "Hi there"
    script_ok(scripted, ids.peek(), " there")
    resp = client.post("/v1/completions", json={"prompt": "Hi", "echo": True, "stream": True})
    chunks = sse_payloads(resp.get_data(as_text=True))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hi there"


def test_echo_with_logprobs_is_refused_clearly(client: FlaskClient) -> None:
    resp = client.post("/v1/completions", json={"prompt": "Hi", "echo": True, "logprobs": 1})
    assert resp.status_code == 400 and error_of(resp)["param"] == "echo"


def test_audio_output_is_refused_clearly(client: FlaskClient) -> None:
    resp = client.post("/v1/chat/completions", json=chat(modalities=["text", "audio"]))
    assert resp.status_code == 400 and "Audio" in error_of(resp)["message"]


def test_reasoning_effort_is_the_template_s_thinking_switch() -> None:
    from app.protocol import parse_chat_request

    req = parse_chat_request(chat(reasoning_effort="none"))
    assert req.template_variables() == {"reasoning_effort": "none", "enable_thinking": False}
    req = parse_chat_request(
        chat(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    )
    assert req.template_variables() == {"reasoning_effort": "high", "enable_thinking": False}
    with pytest.raises(Exception, match="messages"):
        parse_chat_request(chat(chat_template_kwargs={"messages": []}))


def test_a_suffix_needs_a_model_with_fim_tokens(client: FlaskClient) -> None:
    resp = client.post("/v1/completions", json={"prompt": "def f(", "suffix": "):"})
    assert resp.status_code == 400 and error_of(resp)["param"] == "suffix"
