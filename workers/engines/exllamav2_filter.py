"""A constrained choice's grammar as an exllamav2 sampling filter.

exllamav2 0.3.2 enforces constraints through filters on each ``ExLlamaV2DynamicJob``
(``filters=[...]``): before sampling it calls ``get_next()`` for the allowed token ids
and the ids that end the filter, after sampling it calls ``feed(token)`` (sampler.py
436-515, dynamic.py 1867-1935). ``GrammarFilter`` gives it a ``SequenceGrammar``
(workers/engines/constraint.py) through exactly those calls. It duck-types
``ExLlamaV2Filter`` (filters/base.py) instead of subclassing it, so that it is importable
and tested without exllamav2, torch or a GPU; the generator only ever calls methods.

It never raises into the generator: an exception inside ``iterate()`` would fail every
job of the batch. A grammar error is recorded in ``error`` and the filter then allows
only EOS, ending the job with ``eos_reason == "end_filter"``; the engine reports that
choice as an error (400) instead of an EOS.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from workers.engines.constraint import ConstraintError, SequenceGrammar

logger = logging.getLogger(__name__)


class GrammarFilter:
    """One choice's grammar, driven by exllamav2's sampler (see module doc).

    ``max_new_tokens`` is the choice's budget: the grammar's closing mode starts when
    the tokens left fall within ``CLOSING_TOKENS``, as in the llama.cpp engine.
    """

    allow_return_type_list = True  # get_next() returns a sorted list, not a set

    def __init__(self, grammar: SequenceGrammar, max_new_tokens: int) -> None:
        self.grammar = grammar
        self.tokens_left = max_new_tokens
        self.error: str | None = None
        self.background_result: Future[Any] | None = None

    # -- what the sampler calls -------------------------------------------------------

    def begin(self, prefix_str: str = "") -> None:
        """Called once before the first sample; the grammar already holds any resumed
        prefix (consumed when the job was built), so there is nothing to reset."""

    def feed(self, token: Any) -> None:
        self.tokens_left -= 1
        if self.error is not None:
            return
        tok = int(token.item()) if hasattr(token, "item") else int(token)
        if tok in self.grammar.vocab.eos_ids:
            return  # the end: nothing follows it
        try:
            self.grammar.consume(tok)
        except ConstraintError as exc:
            self._fail(str(exc))

    def next(self) -> tuple[list[int], set[int]]:
        """(allowed ids, the ids among them that end the output)."""
        eos = sorted(self.grammar.vocab.eos_ids)
        if self.error is None:
            try:
                if self.grammar.complete:
                    return eos, set(eos)
                return self.grammar.allowed_ids(self.tokens_left)
            except ConstraintError as exc:
                self._fail(str(exc))
            except Exception:
                logger.exception("grammar filter failed")
                self._fail("the output grammar failed")
        return eos, set(eos)

    def use_background_worker(self) -> bool:
        # The mask is computed on the CPU while the GPU runs the forward pass.
        return True

    def can_mask_logits(self) -> bool:
        return False  # the allowed-ids path (next), which also reports the end

    def background_next(self, pool: ThreadPoolExecutor) -> None:
        assert self.background_result is None
        self.background_result = pool.submit(self.next)

    def background_drop(self) -> None:
        if self.background_result is not None:
            self.background_result.result()
            self.background_result = None

    def get_next(self, mask: bool = False) -> tuple[list[int], set[int]]:
        if mask:
            raise NotImplementedError("GrammarFilter does not precompute logit masks")
        if self.background_result is None:
            return self.next()
        result: tuple[list[int], set[int]] = self.background_result.result()
        self.background_result = None
        return result

    def _fail(self, message: str) -> None:
        logger.warning("constrained choice failed: %s", message)
        self.error = message


__all__ = ["GrammarFilter"]
