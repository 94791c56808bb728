"""A real second vocabulary: Gemma 3 270M's GGUF (SentencePiece, 262,144 pieces, byte
fallback, no space prefix, 6,000 control tokens) turned into a model directory agrees
with llama.cpp loading the same file: the ids of every text, the text of every id
sequence with and without special tokens, and the ids that end a generation (issue 41,
"bring your own model"). The GGUF carries no chat template, so chat uses ChatML, as
llama.cpp's server does."""

from __future__ import annotations

import ctypes
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.model_card import ModelCard, load_model_card, load_tokenizer
from app.prepare import CHATML_TEMPLATE, prepare_model_file
from tests.test_tokenizer_agreement import texts

pytestmark = pytest.mark.unit

VOCAB_SIZE = 262_144


@pytest.fixture(scope="module")
def gemma(gemma_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelCard:
    return load_model_card(prepare_model_file(gemma_gguf, tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def llm(gemma_gguf: Path) -> Iterator[Any]:
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    model = llama_cpp.Llama(str(gemma_gguf), vocab_only=True, verbose=False)
    yield model
    model.close()


def vocab(llm: Any) -> Any:
    import llama_cpp

    return llama_cpp.llama_model_get_vocab(llm._model.model)


def detokenize(llm: Any, ids: list[int], *, special: bool) -> str:
    """llama.cpp's ``llama_detokenize`` (llama-cpp-python's own ``detokenize`` drops a
    piece longer than 32 bytes: Gemma has Tamil pieces of 45)."""
    import llama_cpp

    arr = (llama_cpp.llama_token * len(ids))(*ids)
    buf = ctypes.create_string_buffer(len(ids) * 128 + 16)
    n = llama_cpp.llama_detokenize(vocab(llm), arr, len(ids), buf, len(buf), False, special)
    assert n >= 0
    return buf.raw[:n].decode("utf-8", errors="replace")


def test_the_card_is_what_the_gguf_says(gemma: ModelCard) -> None:
    assert gemma.name == "gemma-3-270m-q4_k_m"
    assert gemma.context_length == 32768
    assert (gemma.bos_token, gemma.bos_token_id, gemma.add_bos_token) == ("<bos>", 2, True)
    assert gemma.eos_token == "<eos>" and gemma.eos_token_ids[0] == 1
    assert gemma.chat_template == CHATML_TEMPLATE
    assert gemma.engines() == ("echo", "llamacpp")


def test_a_generation_ends_where_llama_cpp_ends_it(gemma: ModelCard, llm: Any) -> None:
    import llama_cpp

    v = vocab(llm)
    want = {i for i in range(VOCAB_SIZE) if llama_cpp.llama_vocab_is_eog(v, i)}
    assert set(gemma.eos_token_ids) == want == {1, 106, 212}  # <eos> <end_of_turn> </s>


def test_texts_tokenize_as_llama_cpp_tokenizes_them(gemma: ModelCard, llm: Any) -> None:
    """Special tokens' texts are parsed as special tokens, as llama.cpp's server parses a
    prompt (``parse_special``)."""
    ours = load_tokenizer(gemma)
    extra = ["<start_of_turn>user\nHi<end_of_turn>", "x <eos> y </s>", "  two\n\n\tspaces"]
    mismatches = []
    for text in [*texts(), *extra]:
        want = llm.tokenize(text.encode(), add_bos=False, special=True)
        got = ours.encode(text, add_special_tokens=False).ids
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, f"{len(mismatches)} disagreements, first: {mismatches[0]!r}"


def test_ids_decode_to_llama_cpp_s_text(gemma: ModelCard, llm: Any) -> None:
    """Random id sequences over the whole vocabulary (control, unused and byte tokens,
    pieces of every script), with special tokens shown and skipped."""
    ours = load_tokenizer(gemma)
    rng = random.Random(41)
    mismatches = []
    for _ in range(1500):
        ids = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 12))]
        ids += [rng.choice([1, 2, 106, 212, 255999])]  # the tokens that matter most
        for special in (False, True):
            want = detokenize(llm, ids, special=special)
            got = ours.decode(ids, skip_special_tokens=not special)
            if got != want:
                mismatches.append((ids, special, got, want))
    assert not mismatches, f"{len(mismatches)} disagreements, first: {mismatches[0]!r}"
