"""The official openai SDK against a real stack (echo engine): what a user's code sees.

The echo engine answers a chat with its last user message, so every text is known.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import requests

from tests.e2e.conftest import in_flight
from tests.stack import Stack, wait_for, web_process, web_settings

pytestmark = pytest.mark.e2e

TEXT = "Hello there, my friend! How is 東京 today?"


def sdk(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    # No retries: a 429 must surface as RateLimitError, not be retried away.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with sdk(stack.base_url) as c:
        yield c


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    return stack.settings.served_name


def messages(text: str = TEXT) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


def test_chat(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=messages())  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.model == model
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == TEXT
    assert choice.finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_n2_with_usage(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=messages(),  # type: ignore[arg-type]
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    roles: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        (c,) = chunk.choices
        if c.delta.role:
            roles[c.index] = c.delta.role
        texts[c.index] += c.delta.content or ""
        if c.finish_reason:
            finishes[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {0: TEXT, 1: TEXT}
    assert finishes == {0: "stop", 1: "stop"}
    assert usage is not None
    folded = client.chat.completions.create(model=model, messages=messages(), n=2)  # type: ignore[arg-type]
    assert folded.usage is not None
    assert usage.completion_tokens == folded.usage.completion_tokens


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=messages(),  # type: ignore[arg-type]
        stop=["friend"],
    )
    assert r.choices[0].message.content == "Hello there, my "
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra is not None
    assert r.choices[0].model_extra["stop_reason"] == "friend"


def test_completions_list_of_prompts_n2(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt=["one two three", "four five"], n=2)
    assert [(c.index, c.text) for c in r.choices] == [
        (0, "one two three"),
        (1, "one two three"),
        (2, "four five"),
        (3, "four five"),
    ]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model=model, prompt=["one two three", "four five"], n=2, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in r.choices}


def test_completions_max_tokens(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt=TEXT, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=messages("alpha beta"),  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content
    assert "".join(t.token for t in lp.content).startswith("alpha beta")
    assert all(len(t.top_logprobs) == 2 for t in lp.content)
    streamed = []
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages("alpha beta"),  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    assert [t.token for t in streamed] == [t.token for t in lp.content]
    c = client.completions.create(model=model, prompt="alpha beta", logprobs=1)
    clp = c.choices[0].logprobs
    assert clp is not None and clp.tokens and clp.text_offset
    assert "".join(clp.tokens).startswith("alpha beta")
    assert clp.text_offset[0] == 0


def test_bad_request(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=messages(),  # type: ignore[arg-type]
            temperature=3,
        )
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "temperature"


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=messages())  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_models(client: openai.OpenAI, model: str) -> None:
    assert [m.id for m in client.models.list()] == [model]
    assert client.models.retrieve(model).id == model


def test_authentication(stack: Stack) -> None:
    settings = web_settings(stack.settings, api_keys=["secret-1"], web_workers=1, web_threads=8)
    with web_process(settings, stack.log_dir, name="web-auth"):
        base = f"http://{settings.host}:{settings.port}"
        with sdk(base, "wrong") as wrong, pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        with sdk(base, "secret-1") as right:
            r = right.chat.completions.create(
                model=settings.served_name,
                messages=messages(),  # type: ignore[arg-type]
            )
        assert r.choices[0].message.content == TEXT
        assert requests.get(f"{base}/health", timeout=5).status_code == 200


# -- a slow stack: requests that stay in flight -------------------------------------------


def test_queue_full_is_rate_limit_error(slow_stack: Stack) -> None:
    long_text = "word " * 200  # 10 s at 20 tokens/s
    body = {
        "model": slow_stack.settings.served_name,
        "messages": [{"role": "user", "content": long_text}],
        "stream": True,
    }
    holder = requests.post(
        f"{slow_stack.base_url}/v1/chat/completions", json=body, stream=True, timeout=30
    )
    try:
        assert holder.status_code == 200
        # Keep the iterator alive: dropping it would close the connection (a disconnect).
        lines = holder.iter_lines()
        next(lines)  # the request is admitted and streaming
        with sdk(slow_stack.base_url) as c, pytest.raises(openai.RateLimitError) as info:
            c.chat.completions.create(
                model=slow_stack.settings.served_name,
                messages=messages(),  # type: ignore[arg-type]
            )
        assert info.value.response.headers["retry-after"] == "1"
    finally:
        holder.close()
    wait_for(lambda: in_flight(slow_stack.settings) == 0, 10, "the slot to be released")
