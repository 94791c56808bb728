"""The prepared GPU run's comparisons (benchmarks/gpu_reference.py, gpu_phases.py), here
on the exllamav2 engine over the stand-in generator with a toy model as both the
generator's logits and the reference: the device gets one try, so the checks are proved
to pass on a working engine and to fail on a broken one first."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from benchmarks.gpu_check import Phases
from benchmarks.gpu_phases import Backend, paged_phase, unpaged_phase
from benchmarks.gpu_reference import TransformersReference, agreement, log_softmax, penalized
from tests.engines.exllamav2_standin import VOCAB, StandInDynamicGenerator, stand_in_api
from workers.engines import exllamav2_jobs

pytestmark = pytest.mark.unit  # fakes only: no engine weights, no server

EOS = 0


def chain(ids: Sequence[int]) -> np.ndarray:
    """A deterministic 'model': the best next token follows from the last one (a short
    cycle, so tokens repeat), never EOS; the rest trail it by less than the penalties
    of a repeated token, so penalties change the pick."""
    best = (ids[-1] * 3 + 1) % 7 + 1
    row = np.linspace(1.0, 0.0, VOCAB).astype(np.float32)
    row[best] = 2.0
    row[EOS] = -50.0
    return row


class ToyReference(TransformersReference):
    """The reference's checks over ``chain`` instead of transformers."""

    def __init__(self) -> None:
        self.device = "cpu"
        self.version = "toy"

    def rows(self, prompt: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        seq = [*prompt, *tokens]
        return np.stack([chain(seq[: len(prompt) + i]) for i in range(len(tokens))])

    def next_logits(self, sequence: Sequence[int]) -> np.ndarray:
        return chain(sequence)


def backend() -> Backend:
    return Backend(
        "toy",
        stand_in_api(),
        VOCAB,
        lambda paged, batch, cache: StandInDynamicGenerator(
            logits=chain, max_batch_size=batch, paged=paged, cache_tokens=cache
        ),
    )


PROMPTS = [[1, 2 + i, 3 * i % 50 + 1] for i in range(6)]


def test_penalized_applies_repetition_then_output_penalties_then_bias() -> None:
    row = np.array([2.0, -1.0, 0.5, 3.0])
    out = penalized(
        row, [0, 1, 1], [1, 1, 2], repetition=2.0, presence=0.5, frequency=0.25, bias={3: -1.0}
    )
    # 0: seen in context, positive: 2/2. 1: negative: -1*2, then twice generated:
    # -(0.25*2 + 0.5). 2: only generated (not in context): 0.5 - 0.75. 3: bias.
    assert out.tolist() == [1.0, -3.0, -0.25, 2.0]


def test_agreement_flags_a_token_below_the_margin_and_a_wrong_logprob() -> None:
    rows = np.array([[0.0, 1.0, 0.9], [2.0, 0.0, 0.0]])
    good = agreement(
        rows, [5], [1, 0], margin=0.2, logprobs=list(log_softmax(rows)[[0, 1], [1, 0]])
    )
    assert good.over == 0 and good.argmax_equal == 2 and good.max_logprob_error < 1e-9
    near = agreement(rows, [5], [2, 0], margin=0.2)
    assert near.over == 0 and near.argmax_equal == 1 and abs(near.max_margin - 0.1) < 1e-6
    wrong = agreement(rows, [5], [1, 2], margin=0.2, logprobs=[-0.6, -0.1])
    assert wrong.over == 1 and wrong.max_margin == 2.0 and wrong.max_logprob_error > 1
    assert not wrong.summary(0.2)["ok"]


def unpaged(ref: TransformersReference) -> dict:
    return unpaged_phase(
        backend(),
        ref,
        PROMPTS[:2],
        tokens=12,
        long_tokens=30,
        segment_tokens=7,
        cache_tokens=512,
        margin=0.5,
        logprob_tolerance=0.01,
    )


def test_the_phases_pass_on_a_working_engine_and_take_every_path() -> None:
    result = unpaged(ToyReference())
    assert result["ok"], result
    assert result["ids_equal"] and result["raw"]["max_active"] == 1
    assert result["segments"]["ids_equal"] and result["segments"]["common_prefix"] == 30
    paths = result["paths"]
    assert all(paths[p]["ok"] for p in ("logit_bias", "stop_token", "cancel", "logprobs"))
    assert paths["stop_token"]["finish"] == "eos" and paths["cancel"]["finish"] == "cancelled"
    assert paths["penalties"]["ok"] and paths["penalties"]["changed_output"]
    paged = paged_phase(
        backend(), ToyReference(), PROMPTS, tokens=12, cache_tokens=4096, margin=0.5
    )
    assert paged["ok"] and paged["engine"]["max_active"] == len(PROMPTS)
    assert paged["raw"]["tokens"] == paged["engine"]["tokens"] == 12 * len(PROMPTS)


def test_the_phases_fail_when_the_engine_gets_penalties_or_logprobs_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Output penalties never applied, and logprobs taken from shifted logits.
    monkeypatch.setattr(exllamav2_jobs.OutputPenalties, "count", lambda self, tokens: None)
    real = exllamav2_jobs.token_logprobs
    monkeypatch.setattr(
        exllamav2_jobs,
        "token_logprobs",
        lambda logits, ids, k: real(np.asarray(logits) * 1.5, ids, k),
    )
    result = unpaged(ToyReference())
    assert not result["ok"]
    assert not result["paths"]["penalties"]["ok"]
    assert not result["paths"]["logprobs"]["ok"]
    assert result["ids_equal"]  # the plain greedy runs are still right


def test_phases_write_each_result_as_it_ends_and_record_a_failure(tmp_path: Path) -> None:
    phases = Phases(tmp_path)
    assert phases.run("first", lambda: {"ok": True, "value": 1, "_hidden": 2}) is not None
    written = json.loads((tmp_path / "01-first.json").read_text())
    assert written["value"] == 1 and "_hidden" not in written and written["phase"] == "first"
    assert written["started"] <= written["ended"]

    def boom() -> dict:
        raise RuntimeError("no CUDA")

    assert phases.run("second", boom) is None
    failed = json.loads((tmp_path / "02-second.json").read_text())
    assert not failed["ok"] and "RuntimeError: no CUDA" in failed["error"]
    assert "Traceback" in failed["traceback"]
    assert not phases.finish()
    assert json.loads((tmp_path / "summary.json").read_text())["passed"] is False
