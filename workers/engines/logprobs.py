"""Logprobs as both engines report them: the log-softmax of the model's raw logits.

"Raw": before logit_bias, penalties, a grammar's mask or the min_tokens block, and
before temperature and truncation, as vLLM reports them by default. The llama.cpp engine
reads its logits row before its sampler chain; the exllamav2 engine gets rows its
sampler already changed and takes them back first (``exllamav2_jobs.raw_logits``).

Cheap because it runs on the engine thread, once per token of every choice that asked:
one pass for the log-sum-exp, and the top k found among the few ids near the maximum
instead of a partition of the whole vocabulary (numpy's ``argpartition`` over 49,152
logits took 360 to 590 µs here; this 25 to 45 µs).
"""

from __future__ import annotations

import numpy as np

from app.messages import TokenLogprob

# What a logprob of -inf (a token the grammar or the vocab padding ruled out) is
# published as: JSON has no -Infinity, and vLLM's OpenAI server uses the same floor.
LOGPROB_FLOOR = -9999.0

# Widths (in logits) below the maximum searched for the top k before the whole row is
# partitioned; a band holding more than _MAX_BAND ids is partitioned instead.
_BANDS = (1.0, 4.0, 16.0)
_MAX_BAND = 1024


def top_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` largest entries' ids, largest first, ties by lower id (as a stable
    sort of the whole row would give them)."""
    peak = float(row.max())
    cand: np.ndarray | None = None
    for width in _BANDS:
        band = np.flatnonzero(row >= peak - width)
        if len(band) >= k:
            cand = band
            break
    if cand is None or len(cand) > _MAX_BAND:
        kk = min(k, row.shape[0])
        cand = np.sort(np.argpartition(row, -kk)[-kk:])
        # Ties at the k-th value: every id holding it, so the lowest ones are kept.
        cand = np.union1d(cand, np.flatnonzero(row == row[cand].min()))
    order = np.argsort(-row[cand], kind="stable")[:k]
    return cand[order]


def log_sum_exp(row: np.ndarray) -> float:
    peak = float(row.max())
    with np.errstate(under="ignore"):
        return peak + float(np.log(np.exp(row - peak, dtype=np.float64).sum()))


def logprob(row: np.ndarray, token: int, lse: float) -> float:
    return max(float(row[token]) - lse, LOGPROB_FLOOR)


def top_logprobs(row: np.ndarray, k: int, lse: float) -> list[tuple[int, float]]:
    """The ``k`` most likely ids of one row of raw logits with their logprobs."""
    return [(int(t), logprob(row, int(t), lse)) for t in top_ids(row, k)] if k > 0 else []


def token_logprob(row: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The logprob of ``token`` under one row of raw logits, with the top ``k``."""
    lse = log_sum_exp(row)
    return TokenLogprob(int(token), logprob(row, token, lse), top_logprobs(row, k, lse))


def token_logprobs(rows: np.ndarray, tokens: list[int], k: int) -> list[TokenLogprob]:
    """``token_logprob`` for each row of ``rows`` (n, vocab) and its sampled token."""
    return [token_logprob(np.asarray(row), tok, k) for row, tok in zip(rows, tokens, strict=True)]
