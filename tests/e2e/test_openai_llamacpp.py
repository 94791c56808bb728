"""The openai SDK against a stack running the bundled model on the llamacpp engine."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import requests

from tests.stack import Stack, full_stack, isolated_settings

pytest.importorskip("llama_cpp")
pytest.importorskip("workers.engines.llamacpp")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def llama_stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused", models_dir, web_workers=1, web_threads=8, worker_slots=4
    )
    with full_stack(settings, tmp_path_factory.mktemp("llama-logs"), engine="llamacpp") as s:
        yield s


def test_chat_streamed_equals_plain_at_temperature_0(
    llama_stack: Stack, sdk_client: Callable[..., openai.OpenAI]
) -> None:
    client = sdk_client(f"{llama_stack.base_url}/v1", timeout=120)
    model = llama_stack.settings.served_name
    msgs = [{"role": "user", "content": "Name three colours."}]
    plain = client.chat.completions.create(
        model=model,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
    )
    text = plain.choices[0].message.content
    assert text and plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage is not None and 0 < plain.usage.completion_tokens <= 12
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model,
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert streamed == text
    completion = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4)
    assert completion.choices[0].text


def test_a_second_turn_reports_the_prefix_it_reused(
    llama_stack: Stack, sdk_client: Callable[..., openai.OpenAI]
) -> None:
    """The worker's prefix cache through the whole stack: the next turn of a chat
    reports the previous turn's tokens as cached (OpenAI's usage field), also when a
    stop string ends it, a salted request reuses nothing of an unsalted one, and
    /metrics counts the hits."""
    client = sdk_client(f"{llama_stack.base_url}/v1", timeout=120)
    model = llama_stack.settings.served_name
    msgs: list[dict[str, str]] = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What colour is grass?"},
    ]
    first = client.chat.completions.create(
        model=model,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
    )
    assert first.usage is not None
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And the sky?"},
    ]
    second = client.chat.completions.create(
        model=model,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    # At least the first turn's prompt (its reply may be tokenized differently).
    assert first.usage.prompt_tokens - 1 <= cached < second.usage.prompt_tokens
    salted = client.chat.completions.create(
        model=model,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"cache_salt": "another-tenant"},
    )
    assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    # A stop string ends the answer in the streamer, before the worker's finish comes:
    # the usage still has the count (the worker sends it with the first token).
    reply = second.choices[0].message.content or ""
    assert reply.strip()
    stopped = client.chat.completions.create(
        model=model,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stop=[reply.strip()[0]],
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.prompt_tokens_details is not None
    assert (stopped.usage.prompt_tokens_details.cached_tokens or 0) >= cached
    metrics = requests.get(f"{llama_stack.base_url}/metrics", timeout=10).text

    def sample(name: str) -> float:
        lines = [ln for ln in metrics.splitlines() if ln.startswith(name + "{")]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

    # Heart-beats carry the counters: wait for one after the requests above.
    deadline = time.monotonic() + 10
    while sample("tokenrelay_worker_prefix_cache_hits_total") < cached:
        assert time.monotonic() < deadline, "no prefix-cache hits in /metrics"
        time.sleep(0.5)
        metrics = requests.get(f"{llama_stack.base_url}/metrics", timeout=10).text
    assert sample("tokenrelay_worker_prefix_cache_queries_total") >= sample(
        "tokenrelay_worker_prefix_cache_hits_total"
    )
