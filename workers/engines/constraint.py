"""Per-sequence grammar state for constrained decoding, shared by the engines.

A ``SequenceGrammar`` wraps one llguidance ``LLMatcher``: before each sample the engine
asks it which tokens the grammar allows (``mask_logits`` on a numpy row for llama.cpp,
``allowed_ids`` for exllamav2's filter interface), after it feeds the sampled token back
(``consume``). When the grammar is complete (``complete``) the choice ends as if by EOS.
It knows nothing of llama.cpp, exllamav2 or torch: each engine builds the
``llguidance.LLTokenizer`` from its own vocabulary and wraps it in a ``GrammarVocab``.

Closing: a grammar alone guarantees a valid *prefix*; a choice cut off by max_tokens
would still end in the middle of a string (a small model easily writes prose inside a
JSON string until its budget runs out). So once a choice has ``CLOSING_TOKENS`` or fewer
tokens left, its allowed set is narrowed to the first non-empty one of
``CLOSING_TIERS``: tokens that close a string (start with ``"``), then tokens that close
an object or array (start with ``}``/``]``), then a separator (start with ``,``: what
ends a number when required properties remain), each made only of closing bytes; only
where the grammar allows none of them (a required key, the suffix, the first digit of
a number) does the whole allowed set remain. No string grows, no nesting level opens
unless the schema forces it, so the output completes within a few tokens per open
level and per missing required property.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from app.grammar import constraint_grammar, grammar_problem, public_grammar_error
from app.records import OutputConstraint
from workers.engines.base import EngineJob, JobRejected

logger = logging.getLogger(__name__)

# Left-over token budget below which a constrained choice only closes what is open.
CLOSING_TOKENS = 48
# (first byte, bytes the whole token may hold), in order of preference.
CLOSING_TIERS: tuple[tuple[bytes, bytes], ...] = (
    (b'"', b'"}]: '),
    (b"}]", b'"}]: '),
    (b",", b', "'),
)


class ConstraintError(Exception):
    """A constraint that cannot be compiled or followed; its message names why and is
    safe to show a client (as a 400: the request asked for it)."""


class GrammarVocab:
    """An engine's vocabulary as llguidance sees it, built once per engine (~0.5 s)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self.size = tokenizer.vocab_size
        self.eos_ids = frozenset(tokenizer.eos_tokens)
        self.closing = np.zeros((len(CLOSING_TIERS), self.size), dtype=bool)
        for tok in range(self.size):
            if tokenizer.is_special_token(tok):
                continue
            piece = tokenizer.decode_bytes([tok])
            for tier, (first, allowed) in enumerate(CLOSING_TIERS):
                if piece and piece[0] in first and set(piece) <= set(allowed):
                    self.closing[tier, tok] = True


def _failed(matcher: llguidance.LLMatcher) -> ConstraintError:
    """The error of a matcher in its error state, as a client may read it."""
    internal = matcher.get_error()
    logger.warning("constrained decoding failed: %s", internal[:2000])
    return ConstraintError(public_grammar_error(internal))


class JobGrammar:
    """One compiled grammar for all choices of a job (they share ``SamplingParams``);
    ``start`` gives each choice its own state, a cheap copy of the compiled matcher."""

    def __init__(self, vocab: GrammarVocab, constraint: OutputConstraint) -> None:
        problem = grammar_problem(constraint)
        if problem is not None:
            raise ConstraintError(f"this JSON schema cannot be enforced: {problem}")
        self.vocab = vocab
        self._matcher = llguidance.LLMatcher(
            vocab.tokenizer, constraint_grammar(constraint), log_level=0
        )
        if self._matcher.is_error():
            raise _failed(self._matcher)

    def start(self, prefix_ids: Iterable[int] = ()) -> SequenceGrammar:
        """A choice's grammar, advanced over the tokens it generated before a resume."""
        seq = SequenceGrammar(self._matcher.deep_copy(), self.vocab)
        for tok in prefix_ids:
            seq.consume(tok)
        return seq


class SequenceGrammar:
    """The grammar state of one choice (see module doc)."""

    __slots__ = ("_bitmask", "_matcher", "vocab")

    def __init__(self, matcher: llguidance.LLMatcher, vocab: GrammarVocab) -> None:
        self._matcher = matcher
        self.vocab = vocab
        self._bitmask = allocate_token_bitmask(1, vocab.size)

    @property
    def complete(self) -> bool:
        """True once the grammar admits no further token (the output is whole)."""
        return bool(self._matcher.is_stopped())

    def allowed(self, tokens_left: int | None = None) -> np.ndarray:
        """A bool array over the vocabulary: True where the grammar allows the token,
        narrowed to closing tokens when ``tokens_left`` is within ``CLOSING_TOKENS``."""
        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        if self._matcher.is_error():
            raise _failed(self._matcher)
        bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
        allowed = bits[: self.vocab.size].astype(bool)
        if tokens_left is not None and tokens_left <= CLOSING_TOKENS:
            for tier in self.vocab.closing:
                closing = allowed & tier
                if closing.any():
                    return closing
        return allowed

    def mask_logits(self, row: np.ndarray, tokens_left: int | None = None) -> None:
        """Set the logits of every token the grammar forbids to -inf, in place."""
        allowed = self.allowed(tokens_left)
        n = min(len(row), len(allowed))
        row[:n][~allowed[:n]] = -np.inf
        row[n:] = -np.inf  # padding past the tokenizer's vocabulary

    def allowed_ids(self, tokens_left: int | None = None) -> tuple[list[int], set[int]]:
        """The token ids the grammar allows next (ascending) and the EOS ids among them
        (sampling one of those ends the output)."""
        allowed = self.allowed(tokens_left)
        ends = {t for t in self.vocab.eos_ids if t < len(allowed) and allowed[t]}
        return np.flatnonzero(allowed).tolist(), ends

    def consume(self, token: int) -> None:
        """Advance over the sampled ``token``; raises ``ConstraintError`` if the grammar
        refuses it (a resumed prefix that does not fit, or a grammar in error)."""
        if not self._matcher.consume_token(token):
            raise _failed(self._matcher)


__all__ = [
    "CLOSING_TIERS",
    "CLOSING_TOKENS",
    "ConstraintError",
    "GrammarVocab",
    "JobGrammar",
    "SequenceGrammar",
    "job_grammars",
    "prepare_grammar",
]


def prepare_grammar(job: EngineJob, vocab: Callable[[], GrammarVocab]) -> None:
    """Compile ``job``'s output grammar into ``job.prepared`` (``Engine.prepare``, on the
    thread that hands the job over: a large schema takes most of a second to compile,
    which on the engine thread would stall every running job past its lease). What
    cannot be built is kept as the error for ``job_grammars`` to reject the job with."""
    if job.sampling.constraint is None or job.prepared is not None:
        return
    try:
        job.prepared = JobGrammar(vocab(), job.sampling.constraint)
    except Exception as exc:
        job.prepared = exc


def job_grammars(job: EngineJob, vocab: Callable[[], GrammarVocab]) -> dict[int, SequenceGrammar]:
    """Each choice's grammar state when ``job`` is constrained, else nothing; ``vocab``
    gives the engine's vocabulary (built on its first constrained job). The grammar is
    compiled here only when ``prepare_grammar`` did not run.

    Engines call it at submit so that a grammar that cannot be built (a schema the web
    tier did not check, a resumed prefix that does not fit it) rejects the job as a 400
    instead of failing later inside a step."""
    constraint = job.sampling.constraint
    if constraint is None:
        return {}
    prepare_grammar(job, vocab)
    try:
        if isinstance(job.prepared, BaseException):
            raise job.prepared
        compiled: JobGrammar = job.prepared
        return {c.index: compiled.start(c.prefix_ids) for c in job.choices}
    except ConstraintError as exc:
        raise JobRejected(str(exc)) from exc
    except Exception as exc:
        logger.error("cannot build the output grammar of job %s: %r", job.job_id, exc)
        raise JobRejected("the output grammar could not be built") from exc
