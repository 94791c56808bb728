"""Reasoning through a real stack (echo engine), and reasoning and tool calls on the chat
page.

The model is the bundled SmolLM2 as a Hugging Face-style directory whose chat template
mentions ``<think>``, so its card's reasoning parser is detected as ``think`` — as for
DeepSeek-R1, Qwen3 or SmolLM3. The echo engine answers with the last user message, so a
test writes the "model's" thinking and answer exactly.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from app.model_card import load_model_card
from app.prepare import MARKER_FILE
from tests.e2e.test_chat_page import CHROMEDRIVER, CHROMIUM, ChatPage, browser
from tests.stack import Stack, full_stack, isolated_settings

pytestmark = pytest.mark.e2e

__all__ = ["browser"]  # the Chromium fixture, shared with the chat page's tests

THINKING = "<think>The user greets me, so I greet back.</think>Hello to you too!"
REASONING = "The user greets me, so I greet back."
ANSWER = "Hello to you too!"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def thinking_models_dir(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model as an HF-style directory (no tokenrelay.json, no weights: the
    echo engine needs none) whose template names a think block."""
    source = models_dir / "SmolLM2-135M-Instruct"
    root = tmp_path_factory.mktemp("thinking-models")
    target = root / "SmolLM2-Thinking"
    target.mkdir()
    for file in source.iterdir():
        if file.suffix != ".gguf" and file.name not in ("tokenrelay.json", MARKER_FILE):
            shutil.copyfile(file, target / file.name)
    template = target / "chat_template.jinja"
    template.write_text(template.read_text() + "{# answers may open with <think> #}")
    card = load_model_card(target)
    assert (card.reasoning_parser, card.tool_call_parser) == ("think", "hermes")
    return root


@pytest.fixture(scope="module")
def thinking_stack(
    thinking_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused",
        thinking_models_dir,
        model="SmolLM2-Thinking",
        echo_tokens_per_second=40.0,
        web_workers=1,
        web_threads=8,
    )
    with full_stack(settings, tmp_path_factory.mktemp("thinking-logs")) as running:
        yield running


def test_reasoning_content_plain_and_streamed(
    thinking_stack: Stack, sdk_client: Callable[..., openai.OpenAI]
) -> None:
    client = sdk_client(f"{thinking_stack.base_url}/v1", timeout=30)
    messages: Any = [{"role": "user", "content": THINKING}]
    model = thinking_stack.settings.served_name
    plain = client.chat.completions.create(model=model, messages=messages)
    message: Any = plain.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    reasoning_tokens = plain.usage.completion_tokens_details.reasoning_tokens
    assert reasoning_tokens is not None and 0 < reasoning_tokens < plain.usage.completion_tokens

    reasoning, content = "", ""
    for chunk in client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True}
    ):
        for choice in chunk.choices:
            delta: Any = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


@pytest.mark.skipif(
    not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
    reason="needs Chromium and its driver (Debian: apt install chromium chromium-driver)",
)
def test_the_chat_page_shows_reasoning_apart_from_the_answer(
    browser: Any, thinking_stack: Stack
) -> None:
    page = ChatPage(browser, thinking_stack.base_url + "/")
    page.say(THINKING)
    page.wait_for(lambda: page.assistant()["state"] == "done", what="the reply")
    assert page.assistant()["text"] == ANSWER
    shown = page.js(
        """
        const turns = document.querySelectorAll('.message.assistant');
        const block = turns[turns.length - 1].querySelector('.reasoning');
        return block && {text: block.textContent, label: block.dataset.label,
                         before: block.nextElementSibling.className};
        """
    )
    assert shown == {"text": REASONING, "label": "Thinking", "before": "content"}


@pytest.mark.skipif(
    not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
    reason="needs Chromium and its driver (Debian: apt install chromium chromium-driver)",
)
def test_the_chat_page_shows_tool_calls(browser: Any, thinking_stack: Stack) -> None:
    page = ChatPage(browser, thinking_stack.base_url + "/")
    # The page offers no tools itself: add one to every chat it sends, as an app would.
    page.js(
        """
        const send = WebSocket.prototype.send;
        WebSocket.prototype.send = function (data) {
          const msg = JSON.parse(data);
          if (msg.type === 'chat') msg.tools = [arguments[0]];
          return send.call(this, JSON.stringify(msg));
        };
        """.replace("arguments[0]", json.dumps(WEATHER))
    )
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    # Set, not typed: Enter in the prompt box sends the message.
    page.js("$('prompt').value = arguments[0]", text + "\n</tool_call>")
    page.element("#send").click()
    page.wait_for(lambda: page.assistant()["state"] == "done", what="the reply")
    reply = page.assistant()
    assert (reply["text"], reply["finish"]) == ("Checking.", "tool_calls")
    assert reply["label"].startswith("called tools")
    calls = page.js(
        """
        const turns = document.querySelectorAll('.message.assistant');
        const block = turns[turns.length - 1].querySelector('.tool-calls');
        return block && [block.textContent, block.dataset.label];
        """
    )
    assert calls == ['get_weather({"city": "Paris"})', "Tool calls"]
