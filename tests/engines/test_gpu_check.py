"""``benchmarks/gpu_check.py``'s check, run here on the exllamav2 engine over the stand-in
generator (no GPU): the device machine gets one try at it, so its logic is proved first."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from app.records import SamplingParams
from benchmarks.gpu_check import check
from tests.engines.exllamav2_standin import VOCAB, StandInDynamicGenerator, stand_in_api
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.exllamav2 import ExLlamaV2Engine

pytestmark = pytest.mark.unit  # fakes only: no engine weights, no server

EOS = 0


def chain(ids: list[int]) -> np.ndarray:
    """A deterministic 'model': the best next token follows from the last three, never
    EOS; the rest trail it, so a bias against the best changes the pick."""
    best = (sum(ids[-3:]) * 31 + len(ids)) % (VOCAB - 2) + 1
    row = np.linspace(-5.0, -6.0, VOCAB).astype(np.float32)
    row[best] = 0.0
    row[EOS] = -50.0
    return row


def make_job_for(max_tokens: int) -> Any:
    def make_job(job_id: str, prompt_ids: list[int], **fields: Any) -> EngineJob:
        fields.setdefault("sampling", SamplingParams(temperature=0.0))
        return EngineJob(
            job_id=job_id,
            prompt_ids=list(prompt_ids),
            choices=[ChoiceJob(0, max_tokens)],
            eos_token_ids=frozenset({EOS}),
            **fields,
        )

    return make_job


def test_the_check_passes_on_a_working_engine_and_takes_every_path() -> None:
    gen = StandInDynamicGenerator(logits=chain, max_batch_size=8)
    engine = ExLlamaV2Engine(gen, vocab_size=VOCAB, api=stand_in_api())
    prompts = [[1, 2 + i, 3 * i % 50 + 1] for i in range(8)]
    result = check(engine, prompts, make_job_for(24), min_exact=1.0, min_prefix=16, decode=str)
    assert result["passed"], result
    assert result["exact_fraction"] == 1.0 and result["requests"] == 8
    assert result["max_batch_reached"] == 8
    paths = result["paths"]
    assert paths["logit_bias"]["ok"] and paths["logit_bias"]["finish"] == "length"
    assert paths["stop_token"]["ok"] and paths["stop_token"]["finish"] == "eos"
    assert paths["cancel"] == {
        "tokens_before_end": 4,
        "finish": "cancelled",
        "next_job_equal": True,
        "ok": True,
    }
    assert not engine.has_work()


def test_the_check_fails_when_batched_output_departs_from_the_reference() -> None:
    gen = StandInDynamicGenerator(logits=chain, max_batch_size=8)
    engine = ExLlamaV2Engine(gen, vocab_size=VOCAB, api=stand_in_api())
    batched = {"on": False}
    real_submit = engine.submit

    def submit(job: EngineJob) -> None:
        # The batched run of prompt 1 gets another prompt: its output departs at once.
        if job.job_id == "batch-1":
            job.prompt_ids = [9, 9, 9]
            batched["on"] = True
        real_submit(job)

    engine.submit = submit  # type: ignore[method-assign]
    prompts = [[1, 2, 3], [4, 5, 6]]
    result = check(engine, prompts, make_job_for(20), min_exact=0.9, min_prefix=16, decode=str)
    assert batched["on"]
    assert not result["passed"]
    assert [r["exact"] for r in result["rows"]] == [True, False]
    assert result["rows"][1]["common_prefix"] < 16
