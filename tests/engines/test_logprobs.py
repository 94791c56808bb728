"""The logprobs both engines report (workers/engines/logprobs.py): the top k found in a
band below the maximum equal a stable sort of the whole row, whatever its shape."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engines.logprobs import LOGPROB_FLOOR, token_logprob, token_logprobs, top_ids

pytestmark = pytest.mark.unit


def stable_top(row: np.ndarray, k: int) -> list[int]:
    return np.argsort(-row, kind="stable")[:k].tolist()


@pytest.mark.parametrize("scale", [0.01, 1.0, 3.0, 30.0])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_ids_equal_a_stable_sort_of_the_whole_row(scale: float, k: int) -> None:
    rng = np.random.default_rng(int(scale * 100) + k)
    for _ in range(20):
        row = (rng.standard_normal(49152) * scale).astype(np.float32)
        assert top_ids(row, k).tolist() == stable_top(row, k)


def test_ties_keep_the_lower_ids_first_in_every_path() -> None:
    flat = np.zeros(5000, dtype=np.float32)  # one band of 5,000: the partition path
    assert top_ids(flat, 3).tolist() == [0, 1, 2]
    peaked = np.full(100, -50.0, dtype=np.float32)
    peaked[[7, 3, 90]] = 1.0  # three tied at the top, found in the first band
    assert top_ids(peaked, 2).tolist() == [3, 7]
    wide = np.full(3000, -100.0, dtype=np.float32)
    wide[[10, 20]] = 0.0
    wide[2000:] = -30.0  # the k-th value past every band, tied 1,000 times
    assert top_ids(wide, 4).tolist() == [10, 20, 2000, 2001]


def test_a_token_logprob_is_the_log_softmax_with_the_floor_for_minus_infinity() -> None:
    row = np.array([0.0, 1.0, 2.0, -np.inf], dtype=np.float32)
    ref = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
    lp = token_logprob(row, 1, 2)
    assert lp.logprob == pytest.approx(ref[1])
    assert [t for t, _ in lp.top] == [2, 1]
    assert lp.top[0][1] == pytest.approx(ref[2])
    (masked,) = token_logprobs(row[None], [3], 0)
    assert masked.logprob == LOGPROB_FLOOR and masked.top == []
