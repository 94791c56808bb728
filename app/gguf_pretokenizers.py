"""llama.cpp's BPE pre-tokenizers (``tokenizer.ggml.pre``) as ``tokenizers`` pre-tokenizers.

llama.cpp (src/llama-vocab.cpp) maps each ``tokenizer.ggml.pre`` name to a
``LLAMA_VOCAB_PRE_TYPE_*`` with a few flags, and each type to a list of regexes; each
regex splits every piece the one before left, its matches and the text between them both
kept as pieces: ``Split(behavior="isolated")`` here, once per regex, then GPT-2's byte
alphabet (``ByteLevel(use_regex=False)``). The patterns below are llama.cpp's, but its
regex engine (src/unicode.cpp) is not Oniguruma, so where the two differ the pattern is
rewritten to match what llama.cpp matches:

* a regex with ``\\p{...}`` runs on a copy of the text with each non-ASCII character
  replaced by its category, and ``\\p{Lu}``, ``\\p{Ll}``, ``\\p{Lt}``, ``\\p{Lm}``,
  ``\\p{Lo}`` all become that one "letter" category: here they are ``\\p{L}``;
* a regex without one runs on ``std::wregex``, which sees every non-ASCII whitespace as
  ``\\v``: its literal ranges never match such a character (taken out of them here), its
  ``\\d`` is ASCII (``[0-9]``) and its ``$`` ends the piece (``\\z``);
* the hand-written splitters llama.cpp runs instead of some regexes (its GPT-2, llama 3,
  Qwen 2 and Qwen 3.5 fast paths match what their regexes say) have their own rules:
  afmoe's and tiny_aya's digit groups keep the text before a number with its first group,
  kimi-k2's Han runs are a fixed list of ranges and its words ignore letter case.

Names llama.cpp knows but that cannot be matched exactly are kept with the reason, so
that such a vocabulary is a clear error rather than a tokenizer that silently disagrees.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, normalizers, pre_tokenizers

__all__ = [
    "SPACE",
    "BPEPre",
    "bpe_pre",
    "known_pre_names",
    "pre_tokenizer",
    "spm_style_normalizer",
]

# SentencePiece's space, for the BPE vocabularies llama.cpp reads as raw UTF-8.
SPACE = "\u2581"


def _chars(spec: str) -> str:
    """Character-class text from hex code points: ``"b5 c0-d6"`` -> ``"\\xb5\\xc0-\\xd6"``
    (llama.cpp's literal ranges, without non-ASCII literals in this file)."""
    out = []
    for item in spec.split():
        lo, _, hi = item.partition("-")
        out.append(chr(int(lo, 16)) + (f"-{chr(int(hi, 16))}" if hi else ""))
    return "".join(out)


_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # llama.cpp's (?i:'s|...)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PRE = r"[^\r\n\p{L}\p{N}]?"
_LM = r"[\p{L}\p{M}]"
_TAIL_N = r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TAIL_N3 = r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_UP, _LOW = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"  # any letter but a-z / A-Z
_UPM, _LOWM = r"((?=[\p{L}\p{M}])([^a-z]))", r"((?=[\p{L}\p{M}])([^A-Z]))"
# deepseek-v3's and afmoe's "[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]": ASCII punctuation.
_ASCII_PUNCT = r"[!-/:-@\[-`{-~]"
_DEEPSEEK3_WORDS = (
    _ASCII_PUNCT + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_KANA_HAN = "[" + _chars("4e00-9fa5 3040-309f 30a0-30ff") + "]+"
# deepseek's "[一-龥ࠀ-一가-퟿]+": U+0800-U+4E00 less the whitespace std::wregex never sees.
_DEEPSEEK_CJK = (
    "["
    + _chars("4e00-9fa5 800-167f 1681-1fff 200b-2027 202a-202e 2030-205e 2060-2fff 3001-4e00")
    + _chars("ac00-d7ff")
    + "]+"
)
_DEEPSEEK_LETTERS = _chars(
    "b5 c0-d6 d8-f6 f8-1ba 1bc-1bf 1c4-293 295-2af 370-373 376 377 37b-37d 37f 386 388-38a"
    " 38c 38e-3a1 3a3-3f5 3f7-481 48a-52f 531-556 10a0-10c5 13a0-13f5 13f8-13fd 1c90-1cba"
    " 1cbd-1cbf 1d00-1d2b 1d6b-1d77 1d79-1d9a 1e00-1f15 1f18-1f1d 1f20-1f45 1f48-1f4d"
    " 1f50-1f57 1f59 1f5b 1f5d 1f5f-1f7d 1f80-1fb4 1fb6-1fbc 1fbe 1fc2-1fc4 1fc6-1fcc"
    " 1fd0-1fd3 1fd6-1fdb 1fe0-1fec 1ff2-1ff4 1ff6-1ffc 2102 2107 210a-2113 2115 2119-211d"
    " 2124 2126 2128 212a-212d 212f-2134 2139 213c-213f 2145-2149 214e 2183 2184 2c00-2c7b"
    " 2c7e-2ce4 2ceb-2cee 2cf2 2cf3 a640-a66d a680-a69b a722-a76f a771-a787 a78b-a78e"
    " ab70-abbf fb00-fb06 fb13-fb17 ff21-ff3a ff41-ff5a 10400-1044f 104b0-104d3"
    " 104d8-104fb 10c80-10cb2 10cc0-10cf2 118a0-118df 1e900-1e943"
)
_FINNISH = r" ?[^(\s|.,!?" + _chars("2026 3002 ff0c 3001 964 6d4 60c") + ")]+"
# llama.cpp's digit splitter for afmoe and tiny_aya: groups of three from the right, the
# text since the previous group kept with a number's first group ("ab1234" -> "ab1", "234").
_DIGIT_GROUPS = r"(?:\A|(?<=\p{N}))\P{N}*+\p{N}{1,3}(?=(?:\p{N}{3})*+(?!\p{N}))"
_YOUTU_PUNCT = _chars("ff01 2026 201c 201d 2018 2019 2014 ff1a ff1b ff0c 3001-303f fe30-fe4f")
_YOUTU_CJK = (
    f"[{_chars('ac00-d7a3 3131-318e')}]+|[{_YOUTU_PUNCT}]+|[{_chars('3105-312f')}]+|{_KANA_HAN}"
)
_HAN = _chars("4e00-9fff 3400-4dbf 20000-2a6df 2a700-2b73f 2b740-2b81f 2b820-2ceaf 2ceb0-2ebef")
_HAN += _chars("f900-faff 2f800-2fa1f")  # unicode_cpt_is_han()

_SPLITS: dict[str, tuple[str, ...]] = {
    # No or "default" pre: more than GPT-2's regex.
    "DEFAULT": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "LLAMA3": (_LLAMA3,),
    "JAIS2": (
        _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
        r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ),
    "DEEPSEEK_LLM": (
        r"[\r\n]",
        r"\s?[A-Za-z" + _DEEPSEEK_LETTERS + "]+",
        # U+3000 is whitespace: never in "　-。" for llama.cpp.
        r"\s?[!-/:-~" + _chars("ff01-ff0f ff1a-ff5e 2018-201f 3001-3002") + "]+",
        r"\s+\z",
        _DEEPSEEK_CJK,
        r"\p{N}+",
    ),
    "DEEPSEEK3_LLM": (r"\p{N}{1,3}", _KANA_HAN, _DEEPSEEK3_WORDS),
    "SPARK2_5": (
        r"\p{N}{1,3}",
        _KANA_HAN,
        _ASCII_PUNCT + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]"
        r"|\s+(?!\S)|\s+",
        r"\p{N}",
    ),
    "YOUTU": (
        _YOUTU_CJK,
        f"{_PRE}{_LM}*{_LM}+{_C}?|{_PRE}{_LM}+{_LM}*{_C}?{_TAIL_N}",
    ),
    "DEEPSEEK_CODER": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"),
    "FALCON": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "SMOLLM": (r"\p{N}", _GPT2),  # also starcoder, refact, command-r, codeshell, ...
    "GPT2": (_GPT2,),  # also mpt, olmo, jais, trillion, granite-docling
    "QWEN2": (_QWEN2,),  # also stablelm2, hunyuan, solar-open, grok-2
    "QWEN35": (
        _C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "BLOOM": (_FINNISH,),  # also poro, gpt3-finnish
    "VIKING": (_FINNISH, r"\p{N}"),
    "TEKKEN": (f"{_PRE}{_UP}*{_LOW}+|{_PRE}{_UP}+{_LOW}*{_TAIL_N}",),
    "CHAMELEON": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ),
    "GPT4O": (f"{_PRE}{_UP}*{_LOW}+{_C}?|{_PRE}{_UP}+{_LOW}*{_C}?{_TAIL_N3}",),  # + minimax-m2
    "GRANITE_EMB_MULTI": (f"{_PRE}{_UPM}*{_LOWM}+{_C}?|{_PRE}{_UPM}+{_LOWM}*{_C}?{_TAIL_N3}",),
    "TINY_AYA": (_DIGIT_GROUPS, f"{_PRE}{_LM}*{_LM}+{_C}?|{_PRE}{_LM}+{_LM}*{_C}?{_TAIL_N3}"),
    "KIMI_K2": (
        f"[{_HAN}]+|{_PRE}[\\p{{L}}&&[^{_HAN}]]+{_C}?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "SUPERBPE": (r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))"),
    "BAILINGMOE": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "SEED_CODER": (
        _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "UFAKZEKA": (
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "AFMOE": (
        _DIGIT_GROUPS,
        "["
        + _chars("4e00-9fff 3400-4dbf 8c48-faff 3040-309f 30a0-30ff ff65-ff9f 2f00-2fdf")
        + _chars("e40-e7f e80-eff 1780-17ff 1000-109f aa60-aa7f a9e0-a9ff ac00-d7af 1100-11ff")
        + "]+",
        _DEEPSEEK3_WORDS,
    ),
    "LAGUNA": (r"[^\n]+|[\n]+", _QWEN2),
    "EXAONE_MOE": (
        _C + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "MINICPM5": (
        r"\p{N}{1,3}",
        _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "SARVAM_MOE": (r"[^\n]+|[\n]+",),
    "GEMMA4": (r"[^\n]+|[\n]+",),  # + newline runs looked up whole: unsupported
    "WHITESPACE": (r"\S+",),  # raw UTF-8 in, GPT-2 bytes out: unsupported
}


@dataclass(frozen=True)
class BPEPre:
    """One ``tokenizer.ggml.pre`` as llama.cpp sets it up (llama_vocab::impl::load)."""

    name: str
    splits: tuple[str, ...]
    # The whole piece is one token when the vocabulary has it (before any merge).
    ignore_merges: bool = False
    # llama_detokenize drops the space before ?!., and some apostrophes; llama-server's
    # streamed text (token pieces) does not, and neither does this tokenizer's decoder.
    clean_spaces: bool = True
    # What llama.cpp assumes when the file has no tokenizer.ggml.add_bos_token.
    add_bos: bool = False
    # Raw UTF-8 with spaces as U+2581 (SentencePiece-style), not GPT-2's byte alphabet.
    spm_style: bool = False
    # Why this tokenizer cannot be matched exactly (None: it can).
    unsupported: str | None = None


_GEMMA4 = (
    "llama.cpp looks a run of newlines up whole before merging it (and only such runs); "
    "tokenizers can only look up every piece whole (ignore_merges)"
)
_WHITESPACE = (
    "llama.cpp encodes its pieces as raw UTF-8 but decodes tokens through GPT-2's byte "
    "alphabet, writing [UNK_BYTE_0x..] for any other character"
)


def _rows(
    names: str,
    kind: str,
    *,
    ignore_merges: bool = False,
    clean_spaces: bool = True,
    add_bos: bool = False,
    spm_style: bool = False,
    unsupported: str | None = None,
) -> dict[str, BPEPre]:
    """One branch of llama.cpp's ``tokenizer_pre ==`` chain: its names, its type's
    splits, its flags."""
    splits = _SPLITS[kind]
    return {
        name: BPEPre(name, splits, ignore_merges, clean_spaces, add_bos, spm_style, unsupported)
        for name in names.split()
    }


# In llama.cpp's order; the type where it differs from the first name.
_BY_NAME: dict[str, BPEPre] = {
    **_rows("default", "DEFAULT"),
    **_rows("minicpm5", "MINICPM5", ignore_merges=True),
    **_rows(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        "LLAMA3",
        ignore_merges=True,
        add_bos=True,
    ),
    **_rows("deepseek-llm", "DEEPSEEK_LLM", clean_spaces=False),
    **_rows("deepseek-coder", "DEEPSEEK_CODER", clean_spaces=False),
    **_rows("deepseek-v3", "DEEPSEEK3_LLM", clean_spaces=False),
    **_rows("spark2_5", "SPARK2_5", clean_spaces=False),
    **_rows("youtu", "YOUTU", clean_spaces=False, ignore_merges=True),
    **_rows("falcon", "FALCON"),
    **_rows("mpt", "GPT2"),  # MPT
    **_rows("starcoder", "SMOLLM"),  # STARCODER
    **_rows(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert",
        "GPT2",
    ),
    **_rows("jais-2", "JAIS2"),
    **_rows("gemma4 granite-embed-multi-311m", "GEMMA4", spm_style=True, unsupported=_GEMMA4),
    **_rows("sarvam-moe", "SARVAM_MOE", spm_style=True, clean_spaces=False),
    **_rows("jina-v1-en jina-v2-code roberta-bpe", "GPT2"),  # and a SEP token
    **_rows("whitespace", "WHITESPACE", unsupported=_WHITESPACE),
    **_rows("refact", "SMOLLM"),  # REFACT
    **_rows("command-r", "SMOLLM", clean_spaces=False),  # COMMAND_R
    **_rows("qwen2 deepseek-r1-qwen kormo f2llmv2", "QWEN2", clean_spaces=False),
    **_rows("qwen35", "QWEN35", clean_spaces=False),
    **_rows("stablelm2", "QWEN2"),  # STABLELM2
    **_rows("olmo", "GPT2"),  # OLMO
    **_rows("dbrx", "LLAMA3"),  # DBRX
    **_rows("smaug-bpe", "LLAMA3"),  # SMAUG
    **_rows("poro-chat", "BLOOM", clean_spaces=False),  # PORO
    **_rows("chatglm-bpe", "LLAMA3"),  # CHATGLM4 (and no BOS)
    **_rows("glm4 glm5", "LLAMA3", ignore_merges=True),  # CHATGLM4
    **_rows("viking", "VIKING", clean_spaces=False),
    **_rows("jais", "GPT2"),  # JAIS
    **_rows("tekken", "TEKKEN", clean_spaces=False, ignore_merges=True, add_bos=True),
    **_rows("smollm", "SMOLLM", clean_spaces=False),
    **_rows("codeshell", "SMOLLM"),  # CODESHELL
    **_rows("bloom gpt3-finnish", "BLOOM"),  # BLOOM, GPT3_FINNISH
    **_rows("exaone", "SMOLLM"),  # EXAONE
    **_rows("exaone4", "GPT2"),
    **_rows("exaone-moe", "EXAONE_MOE"),
    **_rows("chameleon", "CHAMELEON", add_bos=True, clean_spaces=False),
    **_rows("minerva-7b", "SMOLLM"),  # MINERVA
    **_rows("megrez", "QWEN2"),
    **_rows("gpt-4o llama4 kanana2 talkie", "GPT4O", clean_spaces=False),
    **_rows("granite-embed-multi-97m", "GRANITE_EMB_MULTI", clean_spaces=False, ignore_merges=True),
    **_rows("tiny_aya cohere2moe", "TINY_AYA", clean_spaces=False),
    **_rows("superbpe", "SUPERBPE", clean_spaces=False),
    **_rows("trillion granite-docling", "GPT2", clean_spaces=False),  # TRILLION, GRANITE_DOCLING
    **_rows("bailingmoe bailingmoe2 llada-moe", "BAILINGMOE", clean_spaces=False),
    **_rows("seed-coder", "SEED_CODER", clean_spaces=False),
    **_rows("hunyuan", "QWEN2", clean_spaces=False),  # HUNYUAN
    # HUNYUAN_DENSE, HY_V4, JOYAI_LLM
    **_rows("hunyuan-dense hy_v4 joyai-llm", "DEEPSEEK3_LLM", clean_spaces=False),
    **_rows("kimi-k2", "KIMI_K2", clean_spaces=False),
    **_rows("ufakzeka", "UFAKZEKA", clean_spaces=False),
    **_rows("grok-2", "QWEN2", clean_spaces=False),  # GROK_2
    **_rows("afmoe", "AFMOE", clean_spaces=False),
    **_rows("laguna", "LAGUNA", clean_spaces=False),
    **_rows("minimax-m2", "GPT4O", clean_spaces=False),  # MINIMAX_M2
    **_rows("solar-open", "QWEN2", clean_spaces=False),  # SOLAR_OPEN
    **_rows("mellum2", "SMOLLM"),  # MELLUM2
}


def known_pre_names() -> tuple[str, ...]:
    """Every ``tokenizer.ggml.pre`` llama.cpp accepts for a BPE vocabulary."""
    return tuple(_BY_NAME)


def bpe_pre(name: str | None) -> BPEPre | None:
    """llama.cpp's set-up for ``name`` (no name: ``default``, as llama.cpp falls back to);
    None for a name llama.cpp does not know (it refuses to load such a file)."""
    return _BY_NAME.get(name or "default")


def pre_tokenizer(pre: BPEPre, tokens: list[str]) -> pre_tokenizers.PreTokenizer:
    """The splits in llama.cpp's order, then GPT-2's byte alphabet; for raw UTF-8, each
    character the vocabulary lacks as its own piece instead: llama.cpp keeps such a
    character as a symbol that no merge joins (then spells it in ``<0xNN>`` tokens, or
    drops it), where ``tokenizers`` would drop it first and merge its neighbours."""
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in pre.splits
    ]
    if pre.spm_style:
        known = sorted({ord(t) for t in tokens if len(t) == 1})
        runs: list[list[int]] = []
        for cp in known:
            if runs and runs[-1][1] == cp - 1:
                runs[-1][1] = cp
            else:
                runs.append([cp, cp])
        chars = "".join(f"\\x{{{lo:x}}}-\\x{{{hi:x}}}" for lo, hi in runs)
        unknown = f"[^{chars}]" if chars else r"[\s\S]"
        steps.append(pre_tokenizers.Split(Regex(unknown), behavior="isolated", invert=False))
    else:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def spm_style_normalizer() -> normalizers.Normalizer:
    """llama_escape_whitespace: every space becomes U+2581 before splitting."""
    return normalizers.Replace(" ", SPACE)
