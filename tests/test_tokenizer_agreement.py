"""The tokenizer.json built from the GGUF agrees with llama.cpp's own tokenizer.

The web tier tokenizes prompts with ``tokenizers`` while the llamacpp engine runs the
GGUF: if the two split a text differently the model sees token sequences it was never
trained on. Texts are generated deterministically across the cases where byte-level BPE
pre-tokenizers usually disagree: code, CJK, emoji, whitespace runs with tabs and
newlines, digits and long numbers, punctuation, contractions, mixed scripts, leading
spaces.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.conftest import bundled_gguf

FRAGMENTS = [
    "def f(x):\n\treturn x**2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null}}',
    "SELECT * FROM users WHERE id=42;",
    "東京は日本の首都です。",
    "我爱自然语言处理",
    "한국어 텍스트",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "Ελληνικά γράμματα",
    "हिन्दी भाषा",
    "emoji 😀🎉👩‍💻🇫🇷 end",
    "   leading spaces",
    "trailing spaces   ",
    "\t\ttabs\tand\t\ttabs",
    "line\n\nbreaks\r\nwindows\rmac",
    "     \n    \n\t \n",
    "1234567890",
    "3.14159265358979323846",
    "$1,000,000.00 and 99.9%",
    "2024-01-15T12:34:56Z",
    "I'm you're he'll we've they'd it's",
    "Don't STOP believin'",
    "!!!???...,,,;;;:::",
    '<html><body class="x">Hi &amp; bye</body></html>',
    "a+b=c; x->y; p::q; r=>s",
    "café naïve résumé Ångström",
    "mixedСкрипты漢字and123数字",
    "ＦＵＬＬ　ＷＩＤＴＨ",
    "zero\u200bwidth\u00a0nbsp",
    "https://example.com/path?q=1&r=two#frag",
    "UPPER lower Title camelCase snake_case kebab-case",
]


def texts() -> Iterator[str]:
    """A few hundred texts: every fragment alone, plus random joins of them."""
    yield from FRAGMENTS
    rng = random.Random(1234)
    seps = ["", " ", "  ", "\n", "\t", " \n ", "\n\n", "   \t"]
    for _ in range(300):
        parts = rng.sample(FRAGMENTS, rng.randint(2, 4))
        text = parts[0]
        for p in parts[1:]:
            text += rng.choice(seps) + p
        if rng.random() < 0.3:
            text = " " * rng.randint(1, 3) + text
        if rng.random() < 0.2:
            text = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(5, 30))) + text
        yield text


@pytest.fixture(scope="module")
def llama_vocab() -> Iterator[object]:
    import logging

    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    llm = llama_cpp.Llama(str(bundled_gguf()), vocab_only=True, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def prepared_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tokenizer.json of a prepared model directory (what the web tier loads)."""
    from app.prepare import prepare_bundled_model

    model = prepare_bundled_model(tmp_path_factory.getbasetemp() / "models")
    return Tokenizer.from_file(str(Path(model) / "tokenizer.json"))


def test_there_are_a_few_hundred_varied_texts() -> None:
    all_texts = list(texts())
    assert len(all_texts) >= 300
    assert len(set(all_texts)) > 300


def test_tokenizer_json_matches_llama_cpp(
    prepared_tokenizer: Tokenizer, llama_vocab: object
) -> None:
    mismatches = []
    for text in texts():
        ours = prepared_tokenizer.encode(text, add_special_tokens=False).ids
        theirs = llama_vocab.tokenize(text.encode(), add_bos=False, special=False)  # type: ignore[attr-defined]
        if ours != theirs:
            mismatches.append((text, ours, theirs))
    assert not mismatches, f"{len(mismatches)} disagreements, first: {mismatches[0]!r}"


def test_special_tokens_match_llama_cpp(prepared_tokenizer: Tokenizer, llama_vocab: object) -> None:
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ours = prepared_tokenizer.encode(text, add_special_tokens=False).ids
    theirs = llama_vocab.tokenize(text.encode(), add_bos=False, special=True)  # type: ignore[attr-defined]
    assert ours == theirs


def test_decoding_round_trips(prepared_tokenizer: Tokenizer) -> None:
    for text in list(texts())[:100]:
        ids = prepared_tokenizer.encode(text, add_special_tokens=False).ids
        assert prepared_tokenizer.decode(ids, skip_special_tokens=False) == text
