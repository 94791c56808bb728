"""Every BPE pre-tokenizer llama.cpp knows (``tokenizer.ggml.pre``) turned into a
``tokenizers`` tokenizer agrees with llama.cpp's own tokenizer on the same file, both
ways: the ids of every text and the text of every id sequence. The GGUFs are synthetic,
written here with the ``gguf`` package, one per pre-tokenizer name: SmolLM2's byte-level
vocabulary and merges, plus a few tokens and merges that make the pre-tokenizers'
differences show in the ids (SmolLM2 has no multi-digit token, so with it alone a
regex that groups digits by three tokenizes like one that splits them one by one).
llama.cpp loads them vocabulary-only. The texts are the byte-level agreement test's and
some that stress where the regexes differ."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.errors import ModelError
from app.gguf_pretokenizers import BPEPre, bpe_pre, known_pre_names
from app.gguf_tokenizer import GGUFVocab, read_gguf_fields, read_gguf_vocab, vocab_from_fields
from tests.test_gguf_spm import detokenize, vocab_only_writer
from tests.test_tokenizer_agreement import texts

pytestmark = pytest.mark.unit

NORMAL = 1

# Where llama.cpp's regexes (and its hand-written splitters) part ways.
STRESS = [
    "12345678", "1234567 89 1,234,567.0001", "abc1234567def 12 x3", "ab\u200b1 x\u200d2",
    "I'M don't YOU'LL we'Re it'sgood we'llsee it'ſ", "a ' b 's 'm 're 've 'll 'd ' ",
    "東京タワー 漢字かなカナ 한국어 ㄱㄴ ㄅㄆ 人々 ⼀ 〇 々",
    "mixedСкрипты漢字and123数字 العربية١٢٣ हिन्दी०१२ ไทย๑๒๓",
    "١٢٣٤٥٦٧ ٣٤ １２３４５ Ⅻ ½ ² ³ ¼",
    "a\n\n\tb\r\n  c   d \t \n", "   ", "\n", " \n\n x", "    four  two\ttab",
    "x 　y\u3000z\u00a0w\u2003v\u0085u", "！\u3000！ 漢\u2003字 （注意）　！！。",
    "!!! ??? ... ,,, ;;; wait... really?! yes, sir.", "$100+200=<300>^~|`",
    "emoji 😀🎉👩‍💻🇫🇷 ✨", "HelloWORLD helloWorld camelCase ÉtéÀ naïve",
    "cafe\u0301 a\u0308 \u0915\u093f", "ſ K Å İ", "\x0b\x0c\x1c\x1d x",
    "<sentinel:12> IMGIMGABCZ", " qwertyuiop qwertyuiop",
]  # fmt: skip

# Merges joining two pieces that only some pre-tokenizers keep together (letter case,
# contractions, combining marks, Han, the whitespace llama.cpp's std::wregex never sees).
JOINS = [
    ("don", "'t"), ("hello", "World"), ("'s", "good"), ("e", "\u0301"), ("人", "々"),
    ("！", "\u3000"), ("漢", "\u2003"), ("١", "٢"),
]  # fmt: skip
# A token no merge makes: only a pre-tokenizer with ignore_merges finds it.
WHOLE = " qwertyuiop"


def byte_level(text: str) -> str:
    """GPT-2's byte alphabet (what a byte-level vocabulary's tokens are written in)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    alphabet = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in alphabet):
        alphabet[b] = chr(256 + n)
    return "".join(alphabet[b] for b in text.encode())


def augmented(
    tokens: list[str], merges: list[str], types: list[int]
) -> tuple[list[str], list[str], list[int]]:
    """SmolLM2's vocabulary plus every 2- and 3-digit number, the ``JOINS`` and ``WHOLE``,
    their merges ranked after SmolLM2's own."""
    from tokenizers import Tokenizer, models

    tokens, merges, types = list(tokens), list(merges), list(types)
    vocab, known = set(tokens), set(merges)
    pairs = [(m[: m.index(" ", 1)], m[m.index(" ", 1) + 1 :]) for m in merges]
    smollm = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, pairs))

    def merge(left: str, right: str) -> None:
        if left + right not in vocab:
            vocab.add(left + right)
            tokens.append(left + right)
            types.append(NORMAL)
        if f"{left} {right}" not in known:
            known.add(f"{left} {right}")
            merges.append(f"{left} {right}")

    def one_token(text: str) -> str:
        parts = smollm.encode(byte_level(text)).tokens
        for part in parts[1:]:
            merge(parts[0], part)
            parts[0] += part
        return parts[0]

    digits = "0123456789"
    for a in digits:
        for b in digits:
            merge(a, b)
    for a in digits:
        for b in digits:
            for c in digits:
                merge(a + b, c)
    for left, right in JOINS:
        merge(one_token(left), one_token(right))
    tokens.append(byte_level(WHOLE))
    types.append(NORMAL)
    return tokens, merges, types


@pytest.fixture(scope="module")
def vocabulary() -> tuple[list[str], list[str], list[int]]:
    """Read once for every pre-tokenizer name: SmolLM2's tokens, merges and types."""
    from gguf import GGUFReader

    from app.prepare import bundled_gguf_path

    reader = GGUFReader(str(bundled_gguf_path()))

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    return augmented(
        field("tokenizer.ggml.tokens"),
        field("tokenizer.ggml.merges"),
        field("tokenizer.ggml.token_type"),
    )


def write_bpe_gguf(path: Path, pre: str | None, vocabulary: tuple) -> None:
    tokens, merges, types = vocabulary
    writer = vocab_only_writer(path)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_llama(path: Path) -> Any:
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


SUPPORTED = [n for n in known_pre_names() if not getattr(bpe_pre(n), "unsupported", None)]
UNSUPPORTED = [n for n in known_pre_names() if n not in SUPPORTED]


@pytest.fixture(scope="module")
def fields(vocabulary: tuple, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The synthetic file's fields, read once: reading 100,000 strings with the ``gguf``
    package takes seconds, and the files differ only in their pre-tokenizer's name."""
    path = tmp_path_factory.mktemp("bpe") / "vocab.gguf"
    write_bpe_gguf(path, None, vocabulary)
    return read_gguf_fields(path)


# Read from their own file end to end (the rest from the fields read once).
READ_WHOLE = {None, "qwen2", "llama-bpe"}


@pytest.fixture(scope="module", params=[*SUPPORTED, None], ids=[*SUPPORTED, "no-pre"])
def pair(
    request: pytest.FixtureRequest,
    vocabulary: tuple,
    fields: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[GGUFVocab, Any, BPEPre]]:
    """Ours and llama.cpp's, on one GGUF per pre-tokenizer name; no name is llama.cpp's
    ``default``."""
    path = tmp_path_factory.mktemp("bpe") / "vocab.gguf"
    write_bpe_gguf(path, request.param, vocabulary)
    llm = load_llama(path)
    pre = bpe_pre(request.param)
    assert pre is not None
    if request.param in READ_WHOLE:
        ours = read_gguf_vocab(path)
    else:
        ours = vocab_from_fields({**fields, "tokenizer.ggml.pre": request.param})
    yield ours, llm, pre
    llm.close()


def test_texts_tokenize_as_llama_cpp_tokenizes_them(pair: tuple) -> None:
    ours, llm, _pre = pair
    all_texts = [*texts(), *STRESS]
    got = [e.ids for e in ours.tokenizer.encode_batch(all_texts, add_special_tokens=False)]
    mismatches = []
    for text, ids in zip(all_texts, got, strict=True):
        want = llm.tokenize(text.encode(), add_bos=False, special=False)
        if ids != want:
            mismatches.append((text, ids, want))
    assert not mismatches, f"{len(mismatches)} disagreements, first: {mismatches[0]!r}"


def test_special_tokens_are_parsed_as_llama_cpp_parses_them(pair: tuple) -> None:
    ours, llm, _pre = pair
    text = "<|im_start|>user\nHi there 123<|im_end|>\n"
    got = ours.tokenizer.encode(text, add_special_tokens=False).ids
    assert got == llm.tokenize(text.encode(), add_bos=False, special=True)


def pieces(llm: Any, ids: list[int]) -> str:
    """llama.cpp's token pieces joined: what llama-server streams."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    out = b""
    buf = ctypes.create_string_buffer(256)
    for i in ids:
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, True)
        assert n >= 0
        out += buf.raw[:n]
    return out.decode("utf-8", errors="replace")


def clean_spaces(text: str) -> str:
    """llama_detokenize's three passes for a vocabulary with ``clean_spaces``: no space
    before ?!., ; " ' " becomes "'"; no space before 's 'm 're 've."""
    for punct in "?!.,":
        text = text.replace(" " + punct, punct)
    text = text.replace(" ' ", "'")
    for suffix in ("'s", "'m", "'re", "'ve"):
        text = text.replace(" " + suffix, suffix)
    return text


def test_ids_decode_to_llama_cpp_s_text(pair: tuple) -> None:
    """Our decoding is llama.cpp's pieces joined, which is llama_detokenize's text where
    the pre-tokenizer does not clean spaces, and that text cleaned where it does."""
    ours, llm, pre = pair
    mismatches = []
    sequences = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in STRESS]
    sequences += [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts()]
    sequences.append(
        llm.tokenize(b"<|im_start|>user\nHi ' there .<|im_end|>", add_bos=False, special=True)
    )
    for ids in sequences:
        got = ours.tokenizer.decode(ids, skip_special_tokens=False)
        streamed, detokenized = pieces(llm, ids), detokenize(llm, ids)
        cleaned = clean_spaces(got) if pre.clean_spaces else got
        if got != streamed or cleaned != detokenized:
            mismatches.append((ids, got, streamed, detokenized))
    assert not mismatches, f"{len(mismatches)} disagreements, first: {mismatches[0]!r}"


def test_bos_is_added_when_llama_cpp_adds_it(pair: tuple) -> None:
    """The file has no add_bos_token flag: llama.cpp's default for the pre-tokenizer."""
    import llama_cpp

    ours, llm, _pre = pair
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    assert ours.add_bos_token is bool(llama_cpp.llama_vocab_get_add_bos(vocab))


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_what_cannot_match_llama_cpp_is_a_model_error(
    name: str, vocabulary: tuple, tmp_path: Path
) -> None:
    path = tmp_path / "vocab.gguf"
    write_bpe_gguf(path, name, vocabulary)
    load_llama(path).close()  # llama.cpp knows it
    with pytest.raises(ModelError, match=f"unsupported GGUF pre-tokenizer '{name}': llama.cpp"):
        read_gguf_vocab(path)


def test_a_name_llama_cpp_does_not_know_is_a_model_error(vocabulary: tuple, tmp_path: Path) -> None:
    path = tmp_path / "vocab.gguf"
    write_bpe_gguf(path, "gpt2", vocabulary)  # llama.cpp's name is "gpt-2"
    with pytest.raises(ValueError):
        load_llama(path)
    with pytest.raises(ModelError, match="unknown GGUF pre-tokenizer 'gpt2'"):
        read_gguf_vocab(path)
