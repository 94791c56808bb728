"""The text and raw bytes of single tokens, for logprobs (pure, cached per request).

Split out of app.decoder (which re-exports ``TokenTexts``): the Decoder turns a
choice's tokens into text; this gives each token's own text and bytes, as OpenAI's
logprob entries carry them.
"""

from __future__ import annotations

import re

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel

from app.messages import LogprobEntry, TokenLogprob

__all__ = ["TokenTexts"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character map, inverted (character -> byte)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenTexts:
    """The text and raw bytes of single tokens, cached; shareable between choices.

    A token's text is ``tokenizer.decode([id], skip_special_tokens=...)`` with the
    request's ``skip_special_tokens`` (true by default, as vLLM and the seed's top-logprob
    repair do), so a special token such as EOS has the text ``""`` unless the client
    asked for special tokens; a lone byte of a multi-byte character decodes to U+FFFD.
    Its bytes are the raw bytes it contributes to the output (for byte-level BPE and
    ``<0xNN>`` byte-fallback tokens), not the UTF-8 of U+FFFD, so a client can
    reassemble split characters as OpenAI's ``bytes`` field intends.
    """

    __slots__ = ("_added", "_alphabet", "_cache", "_skip_special", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._added = frozenset(tokenizer.get_added_tokens_decoder())
        self._alphabet = (
            _byte_level_alphabet() if isinstance(tokenizer.decoder, ByteLevel) else None
        )

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return list(self._lookup(token_id)[1])

    def entry(self, lp: TokenLogprob) -> LogprobEntry:
        text, raw = self._lookup(lp.token_id)
        top = [(self._lookup(t)[0], v) for t, v in lp.top]
        return LogprobEntry(lp.token_id, text, lp.logprob, list(raw), top)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=self._skip_special)
            hit = (text, self._raw_bytes(token_id, text))
            self._cache[token_id] = hit
        return hit

    def _raw_bytes(self, token_id: int, text: str) -> list[int]:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None or token_id in self._added:
            return list(text.encode())
        if self._alphabet is not None:
            alphabet = self._alphabet
            if all(c in alphabet for c in piece):
                return [alphabet[c] for c in piece]
            return list(text.encode())
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback is not None:
            return [int(fallback.group(1), 16)]
        return list(text.encode())
