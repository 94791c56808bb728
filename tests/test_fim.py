"""Fill-in-the-middle: the completions endpoint's ``suffix`` (issue 42). Laid out as
llama.cpp's server lays out an infill prompt (``<PRE> prefix <SUF> suffix <MID>``, BOS
first where the vocabulary adds one), with the FIM tokens found by the texts llama.cpp
looks for; a model without them is a 400 naming ``suffix``."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer

from app.chat_template import PromptBuilder
from app.errors import InvalidRequest
from app.model_card import ModelCard

pytestmark = pytest.mark.unit


def with_fim(tokenizer: Tokenizer, texts: tuple[str, str, str]) -> Tokenizer:
    fim = Tokenizer.from_str(tokenizer.to_str())
    fim.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in texts])
    return fim


@pytest.mark.parametrize(
    "texts",
    [
        ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
        ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ],
)
def test_an_infill_prompt_is_prefix_suffix_middle(
    card: ModelCard, smollm_tokenizer: Tokenizer, texts: tuple[str, str, str]
) -> None:
    tok = with_fim(smollm_tokenizer, texts)
    pre, suf, mid = (tok.token_to_id(t) for t in texts)
    builder = PromptBuilder(card, tok)
    ids = builder.encode_infill("def add(a, b):\n    return ", "\n\nprint(add(1, 2))")
    head = tok.encode("def add(a, b):\n    return ", add_special_tokens=False).ids
    tail = tok.encode("\n\nprint(add(1, 2))", add_special_tokens=False).ids
    assert ids == [pre, *head, suf, *tail, mid]
    bos = PromptBuilder(card.model_copy(update={"add_bos_token": True}), tok)
    assert bos.encode_infill("a", "b")[0] == card.bos_token_id


def test_a_model_without_fim_tokens_cannot_take_a_suffix(
    card: ModelCard, smollm_tokenizer: Tokenizer
) -> None:
    with pytest.raises(InvalidRequest) as err:
        PromptBuilder(card, smollm_tokenizer).encode_infill("a", "b")
    assert err.value.param == "suffix" and "fill-in-the-middle" in err.value.message
