"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model == "llama"``: llama 2, Mistral,
Gemma) turned into a ``tokenizers`` tokenizer agree with llama.cpp's own tokenizer on
the same file, both ways: the ids of every text, and the text of every id sequence
(issue 41, "bring your own model"). The GGUFs are synthetic, written here with the
``gguf`` package: a vocabulary learnt from the texts of the byte-level agreement test
(pieces scored by frequency, every byte as a fallback token, control and user-defined
tokens), with and without the prepended space; llama.cpp loads them vocabulary-only."""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.errors import ModelError
from app.gguf_tokenizer import read_gguf_vocab
from tests.test_tokenizer_agreement import FRAGMENTS, texts

pytestmark = pytest.mark.unit

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def learnt_pieces(size: int) -> list[str]:
    """Pieces as SentencePiece would have them: every character, then the most frequent
    substrings of the words (a word carries the space before it as U+2581)."""
    counts: collections.Counter[str] = collections.Counter()
    chars: set[str] = set()
    for text in texts():
        spaced = text.replace(" ", SPACE)
        chars.update(spaced)
        for word in spaced.replace(SPACE, " " + SPACE).split():
            for i in range(len(word)):
                for j in range(i + 2, min(len(word), i + 8) + 1):
                    counts[word[i:j]] += 1
    chars -= {"\n", "\t", "\r"}  # left to the byte tokens, as in Gemma's vocabulary
    common = [p for p, _n in counts.most_common() if not set(p) & {"\n", "\t", "\r"}]
    return sorted(chars) + common[:size]


def vocab_only_writer(path: Path) -> Any:
    """A GGUF writer with the few llama fields llama.cpp needs to load a vocabulary."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    return writer


def write_spm_gguf(path: Path, *, add_space_prefix: bool) -> list[str]:
    writer = vocab_only_writer(path)
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<mask>"]
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    pieces = [p for p in learnt_pieces(3000) if p not in tokens]
    tokens += pieces
    types += [NORMAL] * len(pieces)
    # Characters first, then by frequency: distinct scores, as a trained model has.
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    write_spm_gguf(path, add_space_prefix=request.param)
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    yield read_gguf_vocab(path).tokenizer, llm
    llm.close()


def test_texts_tokenize_as_llama_cpp_tokenizes_them(pair: tuple) -> None:
    ours, llm = pair
    mismatches = []
    for text in [*texts(), "<mask> and <mask>", "x <mask>y"]:
        got = ours.encode(text, add_special_tokens=False).ids
        want = llm.tokenize(text.encode(), add_bos=False, special=False)
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, f"{len(mismatches)} disagreements, first: {mismatches[0]!r}"


def test_special_tokens_are_parsed_as_llama_cpp_parses_them(pair: tuple) -> None:
    ours, llm = pair
    text = "<start_of_turn>user\nHi there</s>"
    got = ours.encode(text, add_special_tokens=False).ids
    assert got == llm.tokenize(text.encode(), add_bos=False, special=True)


def detokenize(llm: object, ids: list[int]) -> str:
    """llama.cpp's ``llama_detokenize``: with the vocabulary's space prefix, the first
    piece's space is dropped (llama-cpp-python's own ``detokenize`` keeps it)."""
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)  # type: ignore[attr-defined]
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    buf = ctypes.create_string_buffer(len(ids) * 64 + 16)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, True)
    assert n >= 0
    return buf.raw[:n].decode("utf-8", errors="replace")


def test_ids_decode_to_llama_cpp_s_text(pair: tuple) -> None:
    """What the streamer shows is llama.cpp's own detokenization of the ids."""
    ours, llm = pair
    mismatches = []
    for text in list(texts())[:150]:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        want = detokenize(llm, ids)
        got = ours.decode(ids, skip_special_tokens=False)
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, f"{len(mismatches)} disagreements, first: {mismatches[0]!r}"


def test_the_fragments_are_covered_by_the_learnt_pieces() -> None:
    """The vocabulary is not trivial: most text is pieces, not byte fallbacks."""
    pieces = set(learnt_pieces(3000))
    assert len(pieces) > 2000
    assert all(any(SPACE + w[:2] in pieces for w in f.split()[:1]) for f in FRAGMENTS[:5])


def test_a_gguf_file_becomes_a_model_directory_served_as_its_name(tmp_path: Path) -> None:
    """``tokenrelay model add FILE.gguf`` (and ``up --model FILE.gguf``)."""
    from app.model_card import load_model_card, load_tokenizer
    from app.prepare import prepare_model_file

    gguf = tmp_path / "My-Model.Q4.gguf"
    write_spm_gguf(gguf, add_space_prefix=True)
    directory = prepare_model_file(gguf, tmp_path / "models")
    assert directory == tmp_path / "models" / "My-Model.Q4"
    card = load_model_card(directory)
    assert card.context_length == 4096 and card.eos_token_ids == (2,)
    text = "Hello there, café 東京"
    tokenizer = load_tokenizer(card)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text
    assert prepare_model_file(gguf, tmp_path / "models") == directory  # idempotent
    with pytest.raises(ModelError, match=r"missing\.gguf does not exist"):
        prepare_model_file(tmp_path / "missing.gguf", tmp_path / "models")
    (tmp_path / "weights.bin").write_bytes(b"GGUF")
    with pytest.raises(ModelError, match=r"not a \.gguf file"):
        prepare_model_file(tmp_path / "weights.bin", tmp_path / "models")
