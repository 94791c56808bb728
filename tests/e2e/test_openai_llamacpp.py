"""The openai SDK against a stack running the bundled model on the llamacpp engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.stack import Stack, full_stack, isolated_settings

pytest.importorskip("llama_cpp")
pytest.importorskip("workers.engines.llamacpp")

pytestmark = [pytest.mark.integration, pytest.mark.slow]


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
