"""Per-sequence grammar state for constrained decoding, shared by the engines.

A ``SequenceGrammar`` wraps one llguidance ``LLMatcher``: before each sample the engine
asks it which tokens the grammar allows (``mask_logits`` on a numpy row for llama.cpp,
``allowed_ids`` for exllamav2's filter interface), after it feeds the sampled token back
(``consume``). When the grammar is complete (``complete``) the choice ends as if by EOS.
It knows nothing of llama.cpp, exllamav2 or torch: each engine builds the
``llguidance.LLTokenizer`` from its own vocabulary and passes it in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from app.grammar import constraint_grammar, grammar_problem
from app.messages import OutputConstraint

logger = logging.getLogger(__name__)


class ConstraintError(Exception):
    """A constraint that cannot be compiled or followed; its message names why and is
    safe to show a client (as a 400: the request asked for it)."""


class JobGrammar:
    """One compiled grammar for all choices of a job (they share ``SamplingParams``);
    ``start`` gives each choice its own state, a cheap copy of the compiled matcher."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, constraint: OutputConstraint):
        problem = grammar_problem(constraint)
        if problem is not None:
            raise ConstraintError(f"this JSON schema cannot be enforced: {problem}")
        self._matcher = llguidance.LLMatcher(tokenizer, constraint_grammar(constraint), log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"the output grammar failed: {self._matcher.get_error()}")
        self.vocab_size = tokenizer.vocab_size
        self.eos_ids = tuple(tokenizer.eos_tokens)

    def start(self, prefix_ids: Iterable[int] = ()) -> SequenceGrammar:
        """A choice's grammar, advanced over the tokens it generated before a resume."""
        seq = SequenceGrammar(self._matcher.deep_copy(), self.vocab_size, self.eos_ids)
        for tok in prefix_ids:
            seq.consume(tok)
        return seq


class SequenceGrammar:
    """The grammar state of one choice (see module doc)."""

    __slots__ = ("_bitmask", "_matcher", "eos_ids", "vocab_size")

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: Iterable[int]
    ) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self._bitmask = allocate_token_bitmask(1, vocab_size)

    @property
    def complete(self) -> bool:
        """True once the grammar admits no further token (the output is whole)."""
        return bool(self._matcher.is_stopped())

    def allowed(self) -> np.ndarray:
        """A bool array over the vocabulary: True where the grammar allows the token."""
        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        if self._matcher.is_error():
            raise ConstraintError(f"the output grammar failed: {self._matcher.get_error()}")
        bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def mask_logits(self, row: np.ndarray) -> None:
        """Set the logits of every token the grammar forbids to -inf, in place."""
        allowed = self.allowed()
        n = min(len(row), len(allowed))
        row[:n][~allowed[:n]] = -np.inf
        row[n:] = -np.inf  # padding past the tokenizer's vocabulary

    def allowed_ids(self) -> tuple[list[int], set[int]]:
        """The token ids the grammar allows next (ascending) and the EOS ids among them."""
        allowed = self.allowed()
        return np.flatnonzero(allowed).tolist(), self.end_ids(allowed)

    def end_ids(self, allowed: np.ndarray) -> set[int]:
        """The EOS ids among ``allowed`` (the grammar is complete or may stop here)."""
        return {t for t in self.eos_ids if t < len(allowed) and allowed[t]}

    def consume(self, token: int) -> None:
        """Advance over the sampled ``token``; raises ``ConstraintError`` if the grammar
        refuses it (a token the mask did not allow: a bug or a resumed prefix that no
        longer fits)."""
        if not self._matcher.consume_token(token):
            raise ConstraintError(f"the output grammar failed: {self._matcher.get_error()}")


__all__ = ["ConstraintError", "JobGrammar", "SequenceGrammar"]
