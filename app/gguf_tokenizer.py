"""Build a ``tokenizers`` tokenizer (``tokenizer.json``) from a GGUF file's vocabulary.

transformers' GGUF loader does the same but needs torch just to read a vocabulary; the
``gguf`` package reads the tokens, merges, token types and pre-tokenizer name directly.
Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``, with the pre-tokenizers
llama.cpp names below) and SentencePiece ones (``"llama"``: llama 2, Mistral, Gemma) are
supported; anything else is a clear ``ModelError`` rather than a tokenizer that silently
disagrees with the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from app.errors import ModelError

# llama.cpp's token types (llama_token_type / gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The split regexes llama.cpp applies for each `tokenizer.ggml.pre` (llama-vocab.cpp).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level
    if pre == "smollm":
        # llama.cpp: "\\p{N}" then the GPT-2 pattern == HF's Digits(individual) + ByteLevel.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelError(
        f"unsupported GGUF pre-tokenizer {pre!r} (supported: smollm, gpt-2, llama-bpe)"
    )


@dataclass(frozen=True)
class GGUFVocab:
    """What a model card needs from a GGUF file's metadata."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    context_length: int | None
    name: str | None
    special_tokens: dict[str, int]
    # Every id that ends a generation, as llama.cpp counts them (the EOS id first).
    eog_token_ids: tuple[int, ...] = ()
    # Every scalar (non-array) metadata field, e.g. ``llama.block_count``: what a
    # config.json needs, without opening the file a second time (that costs seconds).
    metadata: dict[str, Any] = field(default_factory=dict)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    """A GPT-2-style vocabulary (``tokenizer.ggml.model == "gpt2"``): its merges as they
    are, byte-level pre-tokenized as llama.cpp does for ``pre``."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs: list[tuple[str, str]] = []
    for m in merges:
        left, _, right = m.partition(" ")
        pairs.append((left, right))
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], types: list[int], *, add_space_prefix: bool
) -> Tokenizer:
    """A SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``) as llama.cpp
    tokenizes it (llm_tokenizer_spm): spaces become U+2581 (one prepended with
    ``add_space_prefix``), then adjacent pieces merge, the merge whose result scores
    highest first, and what no piece covers falls back to byte tokens (``<0xE2>``).
    A BPE model does the same when its merges are every split of a piece into two
    pieces, ranked by the whole piece's score (transformers' SentencePieceExtractor);
    the decoder undoes it: U+2581 to a space, bytes joined, the prepended space cut."""
    from tokenizers import normalizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    mergeable = [i for i, t in enumerate(types) if t in (_NORMAL, _USER_DEFINED)]
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for i in mergeable:
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], (left, right)))
    ranked.sort()
    unk = next((tokens[i] for i, t in enumerate(types) if t == _UNKNOWN), None)
    bpe = models.BPE(
        vocab=vocab,
        merges=[pair for *_rank, pair in ranked],
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    undo: list[decoders.Decoder] = [
        decoders.Replace("\u2581", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        undo.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(undo)
    return tokenizer


# The texts llama.cpp (llama-vocab.cpp, "maintain a list of tokens that cause
# end-of-generation") treats as ending a generation whatever their type, and those it
# looks for when the file names no fill-in-the-middle pad, repo or file-separator token
# (which end a generation too). Such tokens become control tokens there, so here too.
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
        "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    )
)  # fmt: skip
_FIM_TEXTS = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": (
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    ),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}  # fmt: skip


def _end_of_generation_ids(reader: Any, tokens: list[str]) -> tuple[int, ...]:
    """llama.cpp's EOG set: the EOS, EOT and EOM ids the file names, its FIM pad, repo
    and separator tokens (named, else found by text), and every token whose text is in
    ``_EOG_TEXTS``, less the exceptions llama.cpp makes (``<|end|>`` beside
    ``<|return|>`` and ``<|call|>``; a plain ``</s>`` beside Gemma 4's markers)."""
    index = {t: i for i, t in enumerate(tokens)}
    named = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    for key, texts in _FIM_TEXTS.items():
        found = _field(reader, key)
        if found is None:
            found = next((index[t] for t in texts if t in index), None)
        named.append(found)
    ids = {i for i in named if isinstance(i, int) and 0 <= i < len(tokens)}
    ids |= {index[t] for t in _EOG_TEXTS if t in index}
    texts_ = {tokens[i] for i in ids}
    calls = {"<|call|>", "<|calls|>"} & texts_
    if "<|end|>" in texts_ and calls and {"<|return|>", "<|flush|>"} & texts_:
        ids.discard(index["<|end|>"])
    if "</s>" in texts_ and {"<|tool_response>", "<|plamo:eos|>"} & texts_:
        ids.discard(index["</s>"])
    eos = named[0]
    first = [eos] if isinstance(eos, int) and eos in ids else []
    return (*first, *sorted(ids - set(first)))


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_gguf_vocab(path: Path) -> GGUFVocab:
    """Read a GGUF file's tokenizer and the metadata a model card needs."""
    from gguf import GGUFReader  # numpy-backed; only needed when preparing a model

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read GGUF file {path.name}") from exc

    kind = _field(reader, "tokenizer.ggml.model")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    if kind == "gpt2":
        merges: list[str] = _field(reader, "tokenizer.ggml.merges") or []
        pre = _field(reader, "tokenizer.ggml.pre") or "default"
        tokenizer = _byte_level_bpe(tokens, merges, pre)
    elif kind == "llama":
        scores: list[float] = _field(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise ModelError("a SentencePiece GGUF vocabulary without tokenizer.ggml.scores")
        prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
        tokenizer = _sentencepiece_bpe(
            tokens, scores, types, add_space_prefix=True if prefix is None else bool(prefix)
        )
    else:
        raise ModelError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, byte-level BPE; "
            "llama, SentencePiece)"
        )

    specials = {tokens[i]: i for i, t in enumerate(types) if t == _CONTROL}
    eog = _end_of_generation_ids(reader, tokens)
    for i in eog:  # llama.cpp makes an end-of-generation token a control token
        specials.setdefault(tokens[i], i)
    user_defined = [
        tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED and tokens[i] not in specials
    ]
    # Added tokens keep their vocabulary ids (they are already in `vocab`).
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in sorted(specials, key=specials.__getitem__)
        ]
    )
    if user_defined:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    arch = _field(reader, "general.architecture")
    ctx = _field(reader, f"{arch}.context_length") if arch else None
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    return GGUFVocab(
        tokenizer=tokenizer,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(add_bos) if add_bos is not None else False,
        chat_template=_field(reader, "tokenizer.chat_template"),
        context_length=int(ctx) if ctx is not None else None,
        name=_field(reader, "general.name"),
        special_tokens=specials,
        eog_token_ids=eog,
        metadata=_scalar_metadata(reader),
    )


def _scalar_metadata(reader: Any) -> dict[str, Any]:
    from gguf import GGUFValueType

    return {
        key: f.contents()
        for key, f in reader.fields.items()
        if not key.startswith("GGUF.") and f.types and f.types[0] != GGUFValueType.ARRAY
    }
