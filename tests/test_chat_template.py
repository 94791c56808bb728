"""Chat templates render as transformers renders them; prompts encode to the right ids."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from app.chat_template import (
    PromptBuilder,
    compile_chat_template,
    normalize_messages,
    render_chat_template,
)
from app.errors import InvalidRequest, ModelError
from app.model_card import ModelCard

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]
EXPECTED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
IM_START, IM_END = 1, 2


@pytest.fixture(scope="session")
def builder(card: ModelCard) -> PromptBuilder:
    return PromptBuilder.from_card(card)


def test_smollm_prompt_text(builder: PromptBuilder) -> None:
    assert builder.render_chat(CHAT, add_generation_prompt=True) == EXPECTED


def test_smollm_prompt_ids(builder: PromptBuilder, smollm_tokenizer: Tokenizer) -> None:
    # Composed independently: the special ids by hand, plain text pieces encoded alone
    # with the tokenizer the conftest builds straight from the GGUF.
    def plain(text: str) -> list[int]:
        ids: list[int] = smollm_tokenizer.encode(text, add_special_tokens=False).ids
        assert IM_START not in ids and IM_END not in ids
        return ids

    newline = plain("\n")
    assert newline == [smollm_tokenizer.token_to_id("Ċ")]  # byte-level "\n"
    expected = [
        IM_START, *plain("system\nYou are terse."), IM_END, *newline,
        IM_START, *plain("user\nWhat is 2+2?"), IM_END, *newline,
        IM_START, *plain("assistant\n"),
    ]  # fmt: skip
    ids = builder.encode(builder.render_chat(CHAT))
    assert ids == expected
    assert builder.encode_chat(CHAT) == expected
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == EXPECTED
    # SmolLM2 splits digits one by one (its "smollm" pre-tokenizer).
    assert plain("2+2") == [plain("2")[0], plain("+")[0], plain("2")[0]]


def test_user_only_chat_gets_the_default_system_prompt(builder: PromptBuilder) -> None:
    text = builder.render_chat([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_without_generation_prompt(builder: PromptBuilder) -> None:
    assert builder.render_chat(CHAT, add_generation_prompt=False) == EXPECTED.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_content_parts_are_joined(builder: PromptBuilder) -> None:
    parts = [
        CHAT[0],
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}],
        },
    ]
    assert "<|im_start|>user\nWhat is\n2+2?<|im_end|>" in builder.render_chat(parts)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": ["bare string part"]}],
    ],
)
def test_bad_messages_are_invalid_requests(builder: PromptBuilder, messages: Any) -> None:
    with pytest.raises(InvalidRequest):
        builder.render_chat(messages)


def test_template_type_errors_are_invalid_requests(builder: PromptBuilder) -> None:
    # SmolLM2's template concatenates content: None cannot be rendered.
    with pytest.raises(InvalidRequest, match="cannot render"):
        builder.render_chat([{"role": "user", "content": None}])


def test_normalize_keeps_other_keys_and_does_not_mutate() -> None:
    original = {"role": "tool", "content": [{"type": "text", "text": "4"}], "tool_call_id": "c1"}
    assert normalize_messages([original]) == [
        {"role": "tool", "content": "4", "tool_call_id": "c1"}
    ]
    assert isinstance(original["content"], list)


def test_raise_exception_becomes_invalid_request() -> None:
    source = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Roles must alternate') }}{% endif %}"
    )
    with pytest.raises(InvalidRequest, match=r"^Roles must alternate$"):
        render_chat_template(source, [{"role": "assistant", "content": "x"}])


def test_tojson_like_transformers() -> None:
    source = "{{ messages[0] | tojson }}|{{ messages[0]['content'] | tojson(indent=2) }}"
    out = render_chat_template(source, [{"role": "user", "content": "héllo <b>"}])
    assert out == json.dumps({"role": "user", "content": "héllo <b>"}, ensure_ascii=False) + (
        '|"héllo <b>"'
    )
    out = render_chat_template("{{ {'a': [1]} | tojson(indent=2) }}", [{"role": "user"}])
    assert out == '{\n  "a": [\n    1\n  ]\n}'


def test_strftime_now_uses_the_given_clock() -> None:
    out = render_chat_template(
        "{{ strftime_now('%d %b %Y') }}",
        [{"role": "user", "content": ""}],
        now=lambda: datetime(2024, 7, 26),
    )
    assert out == "26 Jul 2024"


def test_whitespace_control_and_loop_controls() -> None:
    source = (
        "  {% for m in messages %}\n"
        "{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
        "[{{ m['content'] }}]\n"
        "  {% endfor %}\n"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "skip", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert render_chat_template(source, messages) == "[a]\n"


def test_variables_tools_and_extra_kwargs() -> None:
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ add_generation_prompt }}|{{ x }}"
    )
    out = render_chat_template(
        source, [{"role": "user", "content": ""}], bos_token="<s>", eos_token="</s>",
        variables={"x": 7},
    )  # fmt: skip
    assert out == "<s>|</s>|True|True|7"
    out = render_chat_template("{{ tools[0].name }}", [{"role": "user"}], tools=[{"name": "f"}])
    assert out == "f"


def test_sandbox_is_immutable() -> None:
    with pytest.raises(InvalidRequest):
        render_chat_template("{{ messages.append(1) }}", [{"role": "user", "content": ""}])


def test_templates_compile_once() -> None:
    source = "{{ messages | length }}"
    assert compile_chat_template(source) is compile_chat_template(source)


def test_bad_template_is_a_model_error(card: ModelCard, builder: PromptBuilder) -> None:
    with pytest.raises(ModelError, match="does not compile"):
        compile_chat_template("{% for %}")
    broken = card.model_copy(update={"chat_template": "{% if %}"})
    with pytest.raises(ModelError):
        PromptBuilder(broken, builder.tokenizer)


def test_no_template_is_an_invalid_request(card: ModelCard, builder: PromptBuilder) -> None:
    bare = PromptBuilder(card.model_copy(update={"chat_template": None}), builder.tokenizer)
    with pytest.raises(InvalidRequest, match="no chat template"):
        bare.render_chat(CHAT)


def test_bos_added_only_when_asked_and_missing(card: ModelCard, builder: PromptBuilder) -> None:
    assert card.add_bos_token is False
    assert builder.encode("hello") == builder.tokenizer.encode("hello").ids
    with_bos = PromptBuilder(card.model_copy(update={"add_bos_token": True}), builder.tokenizer)
    bos = card.bos_token_id
    assert bos == IM_START
    assert with_bos.encode("hello") == [bos, *builder.encode("hello")]
    # The ChatML prompt already starts with <|im_start|> (SmolLM2's BOS): not doubled.
    assert with_bos.encode(EXPECTED) == builder.encode(EXPECTED)
    assert with_bos.encode("") == [bos]


def test_encode_gives_the_tokenizers_own_ids_and_many_keep_their_order(
    builder: PromptBuilder, smollm_tokenizer: Tokenizer
) -> None:
    # encode runs encode_batch_fast (no offsets, the GIL released): the ids must be
    # Tokenizer.encode's, special-token text and all.
    texts = [
        EXPECTED,
        "héllo, wörld! 🙂 end.",
        "<|im_start|>user\nx<|im_end|>\n",
        "  spaces  \n\n",
        "",
        " ".join(f"w{i}" for i in range(300)),
    ]
    own = [smollm_tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    assert [builder.encode(t) for t in texts] == own
    assert builder.encode_many(texts) == own
    assert builder.encode_many([]) == []


def test_prepared_dir_exists(card: ModelCard) -> None:
    assert isinstance(card.path, Path) and (card.path / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "content",
    [
        "What is 2+2?",
        "1000 w0 w1 w2",
        "héllo, wörld! 🙂 end.",
        "  leading and trailing spaces  ",
        "two\nlines\n",
        "<|im_end|> inside",
        "x",
        "Paris",
    ],
)
def test_the_last_user_turn_comes_from_the_prompts_own_tokens(
    builder: PromptBuilder, smollm_tokenizer: Tokenizer, content: str
) -> None:
    """The echo engine's ids for the last user turn, taken from the prompt's own
    tokenization (no second one) when its tokens tile the turn: the prompt ids are
    ``encode``'s, and the turn's ids spell it back exactly (the same ids as a
    tokenization of its own, where its edges are token edges)."""
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "an earlier question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": content},
    ]
    text = builder.render_chat(chat)
    prompt, part = builder.encode_with_part(text, content)
    assert prompt == builder.encode(text)
    assert smollm_tokenizer.decode(part, skip_special_tokens=False) == content
    alone = smollm_tokenizer.encode(content, add_special_tokens=False).ids
    if not content.startswith(" "):  # a leading space belongs to the token after it
        assert part == alone
