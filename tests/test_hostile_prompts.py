"""Issue 16 line 5 ("8 MB prompts are fully tokenized before the context check: 400
after 5.5-9.7 s"): a prompt text longer than the context could hold even at the
vocabulary's longest token is refused before the tokenizer sees it, with the same
``context_length_exceeded`` 400; anything under that bound still gets the exact
token-count check.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from app.chat_template import PromptBuilder
from app.errors import ContextLengthExceeded
from app.intake import Endpoint, Intake, Limits, RecordBuilder, max_chars_per_token
from app.model_card import ModelCard

EIGHT_MB = "word " * (8 * 1024 * 1024 // 5)


class CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to encode (by either call
    PromptBuilder makes)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encoded_chars = 0

    def encode(self, text: str, **kw: Any) -> Any:
        self.encoded_chars += len(text)
        return self.inner.encode(text, **kw)

    def encode_batch_fast(self, texts: list[str], **kw: Any) -> Any:
        self.encoded_chars += sum(len(t) for t in texts)
        return self.inner.encode_batch_fast(texts, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def counted(card: ModelCard) -> tuple[Intake, CountingTokenizer]:
    prompts = PromptBuilder.from_card(card)
    tokenizer = CountingTokenizer(prompts.tokenizer)
    prompts.tokenizer = tokenizer  # type: ignore[assignment]
    builder = RecordBuilder(card, prompts, model_name="m", request_timeout_s=60, clock=time.time)
    return Intake(builder, Limits()), tokenizer


def test_the_bound_is_the_longest_token_times_the_context(card: ModelCard) -> None:
    tokenizer = PromptBuilder.from_card(card).tokenizer
    longest = max(len(t) for t in tokenizer.get_vocab(with_added_tokens=True))
    assert max_chars_per_token(tokenizer) == longest  # SmolLM2: byte-level, no normalizer
    assert max_chars_per_token(object()) == 128  # no vocabulary to read: generous


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (Endpoint.CHAT, {"messages": [{"role": "user", "content": EIGHT_MB}]}, "messages"),
        (Endpoint.COMPLETIONS, {"prompt": EIGHT_MB}, "prompt"),
        (Endpoint.COMPLETIONS, {"prompt": ["short", EIGHT_MB]}, "prompt"),
    ],
)
def test_an_8_mb_prompt_is_refused_before_tokenization(
    counted: tuple[Intake, CountingTokenizer], endpoint: Endpoint, body: dict[str, Any], param: str
) -> None:
    intake, tokenizer = counted
    ctx = intake.builder.card.context_length
    started = time.monotonic()
    with pytest.raises(ContextLengthExceeded) as info:
        intake.prepare(endpoint, body)
    took = time.monotonic() - started
    assert tokenizer.encoded_chars < 100  # the big prompt never reached the tokenizer
    assert took < 2.0  # was 5.5-9.7 s
    assert info.value.param == param and info.value.code == "context_length_exceeded"
    assert info.value.message.startswith(
        f"This model's maximum context length is {ctx} tokens. However, your prompt has "
    )
    assert info.value.message.endswith(
        f"characters, more than {ctx} tokens can hold. Please reduce the length of the prompt."
    )
    # the characters counted: the prompt's own (a chat's, plus its template's)
    assert int(info.value.message.split("your prompt has ")[1].split()[0]) >= len(EIGHT_MB)


def test_a_prompt_under_the_bound_still_gets_the_exact_token_check(
    counted: tuple[Intake, CountingTokenizer],
) -> None:
    intake, tokenizer = counted
    ctx = intake.builder.card.context_length
    text = "word " * (ctx + 10)  # ~ctx+10 tokens, far under the character bound
    with pytest.raises(ContextLengthExceeded) as info:
        intake.prepare(Endpoint.COMPLETIONS, {"prompt": text})
    assert tokenizer.encoded_chars == len(text)
    assert "your prompt has" in info.value.message and "tokens." in info.value.message
    ok = intake.prepare(Endpoint.COMPLETIONS, {"prompt": "word " * 100})
    assert len(ok.record.prompts[0]) <= 101
