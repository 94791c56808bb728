"""Build a ``tokenizers`` tokenizer (``tokenizer.json``) from a GGUF file's vocabulary.

transformers' GGUF loader does the same but needs torch just to read a vocabulary; the
``gguf`` package reads the tokens, merges, token types and pre-tokenizer name directly.
BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) with every ``tokenizer.ggml.pre``
llama.cpp knows (its table, ported in app.gguf_pretokenizers: gpt-2, llama-bpe, qwen2,
deepseek-*, gpt-4o, tekken, kimi-k2, ...) and SentencePiece ones (``"llama"``: llama 2,
Mistral, Gemma) are supported; anything else, and the few pre-tokenizers llama.cpp runs
in a way ``tokenizers`` cannot (gemma4, whitespace), is a clear ``ModelError`` rather
than a tokenizer that silently disagrees with the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models

from app.errors import ModelError
from app.gguf_pretokenizers import (
    SPACE,
    BPEPre,
    bpe_pre,
    known_pre_names,
    pre_tokenizer,
    spm_style_normalizer,
)

# llama.cpp's token types (llama_token_type / gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


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


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: BPEPre) -> Tokenizer:
    """A GPT-2-style vocabulary (``tokenizer.ggml.model == "gpt2"``): its merges as they
    are, pre-tokenized as llama.cpp does for ``pre`` (llm_tokenizer_bpe). The decoder is
    llama.cpp's token pieces joined (what llama-server streams), without
    llama_detokenize's ``clean_spaces`` pass, which rewrites text already streamed."""
    if pre.unsupported:
        raise ModelError(f"unsupported GGUF pre-tokenizer {pre.name!r}: {pre.unsupported}")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # llama.cpp cuts a merge at the first space after its first character (one without
    # such a space pairs two empty strings: it never applies).
    cuts = [(m, m.find(" ", 1)) for m in merges]
    pairs = [(m[:cut], m[cut + 1 :]) for m, cut in cuts if cut > 0]
    bpe = models.BPE(
        vocab=vocab,
        merges=pairs,
        fuse_unk=False,
        byte_fallback=pre.spm_style,
        ignore_merges=pre.ignore_merges,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizer(pre, tokens)
    if pre.spm_style:  # raw UTF-8, spaces as U+2581, <0xNN> for bytes no piece covers
        tokenizer.normalizer = spm_style_normalizer()
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:
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


def _end_of_generation_ids(fields: dict[str, Any], tokens: list[str]) -> tuple[int, ...]:
    """llama.cpp's EOG set: the EOS, EOT and EOM ids the file names, its FIM pad, repo
    and separator tokens (named, else found by text), and every token whose text is in
    ``_EOG_TEXTS``, less the exceptions llama.cpp makes (``<|end|>`` beside
    ``<|return|>`` and ``<|call|>``; a plain ``</s>`` beside Gemma 4's markers)."""
    index = {t: i for i, t in enumerate(tokens)}
    named = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    for key, texts in _FIM_TEXTS.items():
        found = fields.get(key)
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


def read_gguf_fields(path: Path) -> dict[str, Any]:
    """Every metadata field of a GGUF file, as Python values (the slow part of reading
    a vocabulary: 100,000 strings take seconds in the ``gguf`` package)."""
    from gguf import GGUFReader  # numpy-backed; only needed when preparing a model

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read GGUF file {path.name}") from exc
    return {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}


def read_gguf_vocab(path: Path) -> GGUFVocab:
    """Read a GGUF file's tokenizer and the metadata a model card needs."""
    return vocab_from_fields(read_gguf_fields(path))


def _tokenizer_of(
    kind: Any, get: Any, tokens: list[str], types: list[int]
) -> tuple[Tokenizer, bool]:
    """The GGUF vocabulary's model (``tokenizer.ggml.model`` ``kind``) as a tokenizer,
    with whether llama.cpp adds BOS when the file does not say."""
    if kind == "gpt2":
        merges: list[str] = get("tokenizer.ggml.merges") or []
        pre_name = get("tokenizer.ggml.pre")
        pre = bpe_pre(pre_name)
        if pre is None:  # llama.cpp refuses to load the file
            raise ModelError(
                f"unknown GGUF pre-tokenizer {pre_name!r}: llama.cpp knows "
                + ", ".join(known_pre_names())
            )
        return _byte_level_bpe(tokens, merges, pre), pre.add_bos
    if kind == "llama":
        scores: list[float] = get("tokenizer.ggml.scores")
        if scores is None:
            raise ModelError("a SentencePiece GGUF vocabulary without tokenizer.ggml.scores")
        prefix = get("tokenizer.ggml.add_space_prefix")
        tokenizer = _sentencepiece_bpe(
            tokens, scores, types, add_space_prefix=True if prefix is None else bool(prefix)
        )
        return tokenizer, True  # llama.cpp's default for SentencePiece vocabularies
    raise ModelError(
        f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, byte-level BPE; "
        "llama, SentencePiece)"
    )


def vocab_from_fields(fields: dict[str, Any]) -> GGUFVocab:
    """``read_gguf_vocab`` of a file whose fields are ``fields``."""
    get: Any = fields.get  # the fields' values are whatever the file holds
    kind = get("tokenizer.ggml.model")
    tokens: list[str] = get("tokenizer.ggml.tokens")
    types: list[int] = get("tokenizer.ggml.token_type")
    tokenizer, add_bos_default = _tokenizer_of(kind, get, tokens, types)

    specials = {tokens[i]: i for i, t in enumerate(types) if t == _CONTROL}
    eog = _end_of_generation_ids(fields, tokens)
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

    arch = get("general.architecture")
    ctx = get(f"{arch}.context_length") if arch else None
    add_bos = get("tokenizer.ggml.add_bos_token")
    return GGUFVocab(
        tokenizer=tokenizer,
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_id=get("tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(add_bos) if add_bos is not None else add_bos_default,
        chat_template=get("tokenizer.chat_template"),
        context_length=int(ctx) if ctx is not None else None,
        name=get("general.name"),
        special_tokens=specials,
        eog_token_ids=eog,
        metadata={k: v for k, v in fields.items() if not isinstance(v, list)},
    )
