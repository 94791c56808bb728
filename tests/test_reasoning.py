"""The think reasoning parser (app.reasoning): the block at the start, tags split at every
character, templates that open the block in the prompt, unclosed blocks."""

from __future__ import annotations

import pytest

from app.reasoning import ThinkParser, make_reasoning_parser, prompt_opens_block
from app.tags import Content, Piece, Reasoning


def collect(pieces: list[Piece]) -> tuple[str, str]:
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    assert len(pieces) == sum(isinstance(p, Reasoning | Content) for p in pieces)
    return reasoning, content


def run(chunks: list[str], *, start_in_reasoning: bool = False) -> tuple[str, str]:
    parser = make_reasoning_parser("think", start_in_reasoning=start_in_reasoning)
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    return collect(pieces + parser.flush())


def every_split(text: str, *, start_in_reasoning: bool = False) -> tuple[str, str]:
    whole = run([text], start_in_reasoning=start_in_reasoning)
    assert run(list(text), start_in_reasoning=start_in_reasoning) == whole
    for i in range(1, len(text)):
        cut = run([text[:i], text[i:]], start_in_reasoning=start_in_reasoning)
        assert cut == whole, f"cut at {i}: {text[:i]!r}"
    return whole


def test_think_block_then_answer() -> None:
    text = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."
    assert every_split(text) == ("The user wants 2+2. That is 4.\n", "The answer is 4.")


def test_leading_whitespace_before_the_block() -> None:
    assert every_split("\n <think>a</think>b") == ("a", "b")


def test_no_block_is_all_content() -> None:
    assert every_split("  Just an answer.") == ("", "  Just an answer.")
    assert every_split("Text then <think>not reasoning</think>") == (
        "",
        "Text then <think>not reasoning</think>",
    )


def test_partial_open_tag_is_content_at_flush() -> None:
    assert every_split(" <thin") == ("", " <thin")
    assert every_split("<thinking about it") == ("", "<thinking about it")


def test_unclosed_block_stays_reasoning_with_its_partial_close_tag() -> None:
    assert every_split("<think>still thinking </thi") == ("still thinking </thi", "")


def test_block_opened_by_the_template() -> None:
    text = "Okay, so 4.\n</think>\n\n4"
    assert every_split(text, start_in_reasoning=True) == ("Okay, so 4.\n", "4")
    assert every_split("never closed", start_in_reasoning=True) == ("never closed", "")
    # A model that writes the open tag again anyway: it is no reasoning text.
    assert every_split(" <think>\nhm</think>ok", start_in_reasoning=True) == ("hm", "ok")
    assert every_split(" \n", start_in_reasoning=True) == ("", "")
    assert every_split("<thin", start_in_reasoning=True) == ("<thin", "")


def test_partial_close_tag_is_never_reasoning_or_content_early() -> None:
    parser = ThinkParser()
    assert parser.feed("<think>abc</") == [Reasoning("abc")]
    assert parser.in_reasoning
    assert parser.feed("think") == []
    assert parser.feed(">") == []
    assert not parser.in_reasoning
    assert parser.feed("\nx") == [Content("x")]
    assert parser.passthrough
    assert parser.feed("</think>") == [Content("</think>")]


def test_model_specific_tags() -> None:
    parser = make_reasoning_parser("seed_think")
    pieces = [p for c in "<seed:think>hm</seed:think> ok <think>" for p in parser.feed(c)]
    assert collect(pieces + parser.flush()) == ("hm", "ok <think>")
    assert prompt_opens_block("assistant\n<seed:think>", "seed_think")


def test_prompt_opens_block_reads_the_last_tag() -> None:
    assert prompt_opens_block("<|im_start|>assistant\n<think>\n", "think")
    assert not prompt_opens_block("<|im_start|>assistant\n<think>\n\n</think>\n\n", "think")
    assert not prompt_opens_block("<|im_start|>assistant\n", "think")


def test_unknown_reasoning_parser_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        make_reasoning_parser("nope")
