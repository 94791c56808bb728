"""The exllamav2 engine's mapping layer, run against stand-ins (no GPU, no torch here).

The stand-ins (``StandInDynamicGenerator``, ``StandInJob``, ``StandInSettings``) live in
tests/engines/exllamav2_standin.py and are re-exported here for the tests that import
them from this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from app.messages import EngineFinish
from app.records import SamplingParams
from tests.engines.exllamav2_standin import (
    EXL_DEFAULTS,
    PADDED_VOCAB,
    VOCAB,
    StandInDynamicGenerator,
    StandInJob,
    StandInSettings,
    held_back,
    max_tokens,
    stand_in_api,
    stop_token,
    stream,
    toks,
)
from workers.engines.base import ChoiceJob, EngineJob, EngineStep, JobRejected
from workers.engines.exllamav2 import ExLlamaV2Engine
from workers.engines.exllamav2_jobs import NEUTRAL_SETTINGS
from workers.engines.logprobs import token_logprobs

pytestmark = pytest.mark.unit  # fakes only: no engine weights, no server

__all__ = [
    "PADDED_VOCAB",
    "VOCAB",
    "StandInDynamicGenerator",
    "StandInJob",
    "StandInSettings",
    "held_back",
    "max_tokens",
    "stand_in_api",
    "stop_token",
    "stream",
    "toks",
]


def make_engine(
    *, segment_tokens: int = 512, **gen: Any
) -> tuple[ExLlamaV2Engine, StandInDynamicGenerator]:
    generator = StandInDynamicGenerator(**gen)
    engine = ExLlamaV2Engine(
        generator, vocab_size=VOCAB, api=stand_in_api(), segment_tokens=segment_tokens
    )
    return engine, generator


def make_job(
    job_id: str = "j1",
    *,
    n: int = 1,
    prompt: list[int] | None = None,
    max_new_tokens: int = 16,
    sampling: SamplingParams | None = None,
    eos: frozenset[int] = frozenset({2}),
    stop: frozenset[int] = frozenset(),
    min_tokens: int = 0,
    choices: list[ChoiceJob] | None = None,
) -> EngineJob:
    return EngineJob(
        job_id=job_id,
        prompt_ids=prompt if prompt is not None else [1, 10, 11, 12],
        choices=choices or [ChoiceJob(i, max_new_tokens) for i in range(n)],
        sampling=sampling or SamplingParams(),
        eos_token_ids=eos,
        stop_token_ids=stop,
        min_tokens=min_tokens,
    )


def run_until_idle(engine: ExLlamaV2Engine, limit: int = 50) -> list[EngineStep]:
    out: list[EngineStep] = []
    for _ in range(limit):
        if not engine.has_work():
            return out
        out += engine.step()
    raise AssertionError("engine did not finish")


def settings_of(job: StandInJob) -> dict[str, Any]:
    return {k: getattr(job.gen_settings, k) for k in EXL_DEFAULTS}


# --- sampling settings ---------------------------------------------------------------


def test_openai_defaults_replace_every_non_neutral_exllamav2_default() -> None:
    engine, gen = make_engine()
    engine.submit(make_job())
    s = settings_of(gen.enqueued[0])
    assert s == {
        **EXL_DEFAULTS,
        **NEUTRAL_SETTINGS,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "token_repetition_penalty": 1.0,
        "token_presence_penalty": 0.0,
        "token_frequency_penalty": 0.0,
        "token_bias": None,
    }


def test_greedy_is_top_k_1_and_keeps_penalties_and_bias() -> None:
    engine, gen = make_engine()
    sampling = SamplingParams(
        temperature=0.0, top_p=0.5, top_k=7, repetition_penalty=1.2, logit_bias={5: 3.0}
    )
    engine.submit(make_job(sampling=sampling))
    s = gen.enqueued[0].gen_settings
    assert (s.temperature, s.top_k, s.top_p) == (1.0, 1, 0.0)
    assert s.token_repetition_penalty == 1.2
    assert s.token_bias is not None and s.token_bias[5] == 3.0


def test_sampling_values_are_passed_through() -> None:
    engine, gen = make_engine()
    sampling = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        seed=42,
    )
    engine.submit(make_job(sampling=sampling))
    job = gen.enqueued[0]
    s = job.gen_settings
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.7, 0.9, 40, 0.05)
    # presence/frequency live in the choice's token_bias (output tokens only), never
    # in exllamav2's own pass, which counts the prompt too.
    assert (s.token_presence_penalty, s.token_frequency_penalty) == (0.0, 0.0)
    assert s.token_repetition_penalty == 1.1 and s.token_repetition_range == -1
    assert s.token_bias is not None and not np.any(s.token_bias)
    assert job.seed == 42
    assert job.return_logits is False and job.return_top_tokens == 0
    assert job.token_healing is False and job.banned_strings is None


def test_logit_bias_becomes_a_padded_clamped_token_bias() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(sampling=SamplingParams(logit_bias={3: -100.0, 7: 2.5})))
    bias = gen.enqueued[0].gen_settings.token_bias
    assert bias.shape == (PADDED_VOCAB,)
    assert bias[3] == -100.0 and bias[7] == 2.5 and np.count_nonzero(bias) == 2


def test_each_choice_gets_its_own_settings_object() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(n=2))
    assert gen.enqueued[0].gen_settings is not gen.enqueued[1].gen_settings


# --- stop conditions, choices, resume --------------------------------------------------


def test_stop_conditions_are_eos_plus_user_stop_ids() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(eos=frozenset({2, 0}), stop=frozenset({42}), min_tokens=5))
    job = gen.enqueued[0]
    assert job.stop_conditions == [0, 2, 42]
    assert job.min_new_tokens == 5


def test_no_eos_ids_means_no_stop_at_all() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(eos=frozenset()))
    assert gen.enqueued[0].stop_conditions == []


def test_n_choices_are_n_jobs_on_the_same_prompt_with_distinct_seeds() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(n=3, sampling=SamplingParams(seed=7)))
    assert len(gen.enqueued) == 3
    for i, job in enumerate(gen.enqueued):
        assert job.input_ids.tolist() == [[1, 10, 11, 12]]
        assert job.identifier == ("j1", i)
        assert job.seed == 7 + i


def test_resume_appends_the_prefix_and_counts_it_towards_min_tokens() -> None:
    engine, gen = make_engine()
    choices = [ChoiceJob(0, 10, prefix_ids=[20, 21, 22]), ChoiceJob(1, 13)]
    engine.submit(make_job(choices=choices, min_tokens=5))
    resumed, fresh = gen.enqueued
    assert resumed.input_ids.tolist() == [[1, 10, 11, 12, 20, 21, 22]]
    assert (resumed.max_new_tokens, resumed.min_new_tokens) == (10, 2)
    assert fresh.input_ids.tolist() == [[1, 10, 11, 12]]
    assert (fresh.max_new_tokens, fresh.min_new_tokens) == (13, 5)


def test_choice_with_nothing_left_finishes_with_length_without_a_job() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(choices=[ChoiceJob(0, 0, prefix_ids=[5])]))
    assert gen.enqueued == []
    steps = run_until_idle(engine)
    assert [(s.delta.token_ids, s.delta.finish) for s in steps] == [([], EngineFinish.LENGTH)]


# --- results -> deltas -------------------------------------------------------------------


def test_stop_token_eos_publishes_the_held_ids_including_the_stop_token() -> None:
    engine, gen = make_engine()
    engine.submit(make_job())
    gen.script(("j1", 0), stream([30]), held_back(), stop_token([31, 32, 2]))
    steps = run_until_idle(engine)
    assert [(s.job_id, s.delta.token_ids, s.delta.finish) for s in steps] == [
        ("j1", [30], None),
        ("j1", [31, 32, 2], EngineFinish.EOS),
    ]
    assert steps[-1].delta.cached_tokens == 256
    assert steps[-1].delta.logprobs is None
    assert not engine.has_work()


def test_max_new_tokens_is_a_length_finish() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(max_new_tokens=3))
    gen.script(("j1", 0), stream([30]), stream([31]), max_tokens([32]))
    steps = run_until_idle(engine)
    assert [t for s in steps for t in s.delta.token_ids] == [30, 31, 32]
    assert steps[-1].delta.finish is EngineFinish.LENGTH
    assert [s.delta.finish for s in steps[:-1]] == [None, None]


def test_every_choice_gets_exactly_one_finish() -> None:
    engine, gen = make_engine(max_batch_size=2)
    engine.submit(make_job("a", choices=[ChoiceJob(0, 16), ChoiceJob(1, 1)]))
    engine.submit(make_job("b", max_new_tokens=3))
    gen.script(("a", 0), stream([5]), stop_token([2]))
    gen.script(("a", 1), max_tokens([6]))
    gen.script(("b", 0), stream([7]), stream([8]), max_tokens([9]))
    steps = run_until_idle(engine)
    finishes = [(s.job_id, s.delta.choice) for s in steps if s.delta.finish is not None]
    assert sorted(finishes) == [("a", 0), ("a", 1), ("b", 0)]


def test_capacity_is_the_batch_size_paged_and_one_unpaged() -> None:
    assert make_engine(max_batch_size=32)[0].capacity == 32
    assert make_engine(max_batch_size=32, paged=False)[0].capacity == 1


# --- cancel, reject, errors --------------------------------------------------------------


def test_cancel_frees_the_jobs_and_reports_cancelled() -> None:
    engine, gen = make_engine(max_batch_size=1)
    engine.submit(make_job(n=2))
    gen.script(("j1", 0), stream([5]), stream([6]))
    gen.script(("j1", 1), stream([7]))
    first = engine.step()  # choice 0 running, choice 1 still pending in the generator
    assert [s.delta.token_ids for s in first] == [[5]]
    engine.cancel("j1")
    engine.cancel("unknown")
    assert [j.identifier for j in gen.cancelled] == [("j1", 0), ("j1", 1)]
    assert gen.num_remaining_jobs() == 0
    steps = engine.step()
    assert sorted((s.delta.choice, s.delta.finish) for s in steps) == [
        (0, EngineFinish.CANCELLED),
        (1, EngineFinish.CANCELLED),
    ]
    assert not engine.has_work()
    assert engine.step() == []


def test_cancel_after_a_choice_finished_only_cancels_the_rest() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(choices=[ChoiceJob(0, 1), ChoiceJob(1, 16)]))
    gen.script(("j1", 0), max_tokens([5]))
    gen.script(("j1", 1), stream([6]), stream([7]))
    engine.step()
    engine.cancel("j1")
    assert [j.identifier for j in gen.cancelled] == [("j1", 1)]
    assert [(s.delta.choice, s.delta.finish) for s in engine.step()] == [
        (1, EngineFinish.CANCELLED)
    ]


def test_only_a_prompt_with_no_room_in_the_cache_is_rejected() -> None:
    engine, gen = make_engine(cache_tokens=1024)
    with pytest.raises(JobRejected) as exc:
        engine.submit(make_job(prompt=list(range(1, 11)) * 103, max_new_tokens=25))
    assert str(exc.value) == "prompt (1030 tokens) leaves no room in the cache (1024 tokens)"
    with pytest.raises(JobRejected, match=r"prompt \(1024 tokens\) leaves no room"):
        engine.submit(make_job(prompt=[1] * 1020, choices=[ChoiceJob(0, 3, prefix_ids=[5] * 4)]))
    assert gen.enqueued == [] and not engine.has_work()


def test_a_sequence_that_reaches_the_cache_size_finishes_with_length() -> None:
    # prompt + max_tokens (1000 + 100) is more than the cache holds: it generates
    # until the cache is full (24 tokens), then finishes with "length", as a context
    # limit would; it is not a 400 any more.
    engine, gen = make_engine(cache_tokens=1024, segment_tokens=16)
    engine.submit(make_job(prompt=list(range(3, 13)) * 100, max_new_tokens=100, eos=frozenset()))
    steps = run_until_idle(engine, limit=100)
    assert sum(len(s.delta.token_ids) for s in steps) == 24
    assert [s.delta.finish for s in steps if s.delta.finish] == [EngineFinish.LENGTH]
    assert [j.max_new_tokens for j in gen.enqueued] == [16, 8]
    # A resumed prefix fills the cache too: 1019 + 4 leaves room for one token.
    engine.submit(make_job("r", prompt=[1] * 1019, choices=[ChoiceJob(0, 3, prefix_ids=[5] * 4)]))
    steps = run_until_idle(engine)
    assert [(len(s.delta.token_ids), s.delta.finish) for s in steps] == [(1, EngineFinish.LENGTH)]


def test_a_job_longer_than_the_model_context_is_rejected() -> None:
    engine, _ = make_engine(cache_tokens=8192, max_seq_len=2048)
    with pytest.raises(JobRejected, match=r"exceeds the model's context \(2048 tokens\)"):
        engine.submit(make_job(max_new_tokens=2045))


@pytest.mark.parametrize(
    "job",
    [
        make_job(prompt=[]),
        make_job(prompt=[1, VOCAB]),
        make_job(stop=frozenset({VOCAB + 5})),
        make_job(sampling=SamplingParams(logit_bias={VOCAB: 1.0})),
    ],
    ids=["empty", "prompt-id", "stop-id", "bias-id"],
)
def test_ids_the_model_cannot_embed_are_rejected(job: EngineJob) -> None:
    engine, gen = make_engine()
    with pytest.raises(JobRejected):
        engine.submit(job)
    assert gen.enqueued == []


def test_a_duplicate_job_id_is_rejected() -> None:
    engine, _ = make_engine()
    engine.submit(make_job())
    with pytest.raises(JobRejected):
        engine.submit(make_job())


def test_a_failing_job_does_not_affect_another() -> None:
    engine, gen = make_engine()
    engine.submit(make_job("bad"))
    engine.submit(make_job("good"))
    gen.script(("bad", 0), stream([5]), {"eos": False, "token_ids": "not a tensor"})
    gen.script(("good", 0), stream([6]), stream([7]), stop_token([2]))
    steps = run_until_idle(engine)
    bad = [s.delta for s in steps if s.job_id == "bad"]
    good = [s.delta for s in steps if s.job_id == "good"]
    assert [(d.token_ids, d.finish) for d in bad] == [([5], None), ([], EngineFinish.ERROR)]
    assert bad[-1].error
    assert [j.identifier for j in gen.cancelled] == [("bad", 0)]  # its pages are freed
    assert [t for d in good for t in d.token_ids] == [6, 7, 2]
    assert good[-1].finish is EngineFinish.EOS


def test_a_choice_the_generator_refuses_errors_alone() -> None:
    engine, gen = make_engine()
    gen.refuse.add(("j1", 1))
    engine.submit(make_job(max_new_tokens=1, n=2))
    gen.script(("j1", 0), max_tokens([5]))
    steps = run_until_idle(engine)
    assert sorted((s.delta.choice, s.delta.finish) for s in steps) == [
        (0, EngineFinish.LENGTH),
        (1, EngineFinish.ERROR),
    ]


# --- logprobs ----------------------------------------------------------------------------


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - (row.max() + np.log(np.exp(row - row.max()).sum()))


def test_logprobs_come_from_the_logits_aligned_with_the_ids() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(sampling=SamplingParams(logprobs=2, temperature=0.0)))
    assert gen.enqueued[0].return_logits is True
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 3, PADDED_VOCAB)).astype(np.float32)
    logits[..., VOCAB:] = -np.inf  # exllamav2 masks the padding (sampler.py:515-517)
    gen.script(
        ("j1", 0),
        stream([4], logits[:, :1]),
        stop_token([9, 2], logits[:, 1:]),
    )
    steps = run_until_idle(engine)
    lps = [lp for s in steps for lp in (s.delta.logprobs or [])]
    assert [lp.token_id for lp in lps] == [4, 9, 2]
    for i, lp in enumerate(lps):
        ref = log_softmax(logits[0, i])
        assert lp.logprob == pytest.approx(ref[lp.token_id], abs=1e-5)
        best = np.argsort(-ref)[:2]
        assert [t for t, _ in lp.top] == best.tolist()
        assert [v for _, v in lp.top] == pytest.approx(ref[best].tolist(), abs=1e-5)


def test_logprobs_zero_is_the_sampled_token_only() -> None:
    logits = np.array([[0.0, 1.0, 2.0, -np.inf]], dtype=np.float32)
    (lp,) = token_logprobs(logits, [3], 0)
    assert lp.top == []
    assert lp.logprob == -9999.0  # -inf is floored: JSON has no -Infinity


def test_logit_rows_that_do_not_match_the_ids_are_an_error_for_that_job() -> None:
    engine, gen = make_engine()
    engine.submit(make_job(sampling=SamplingParams(logprobs=1)))
    gen.script(("j1", 0), stream([4, 5], np.zeros((1, 1, PADDED_VOCAB), np.float32)))
    (step,) = run_until_idle(engine)
    assert step.delta.finish is EngineFinish.ERROR


# --- GGUF -> HF conversion of the GPU check script (numpy only) --------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py LlamaModel.permute does to q/k weights."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_gguf_tensors_map_to_hf_names_and_q_k_are_unpermuted() -> None:
    from benchmarks.gguf_to_hf import gguf_to_hf_tensors, hf_tensor_name

    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert (
        hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    assert hf_tensor_name("blk.1.ffn_gate.weight") == "model.layers.1.mlp.gate_proj.weight"
    assert hf_tensor_name("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert hf_tensor_name("rope_freqs.weight") is None

    n_head, n_kv, head_dim, hidden = 4, 2, 6, 5
    rng = np.random.default_rng(1)
    q = rng.normal(size=(n_head * head_dim, hidden)).astype(np.float32)
    k = rng.normal(size=(n_kv * head_dim, hidden)).astype(np.float32)
    v = rng.normal(size=(n_kv * head_dim, hidden)).astype(np.float32)
    gguf = [
        ("blk.0.attn_q.weight", llama_cpp_permute(q, n_head)),
        ("blk.0.attn_k.weight", llama_cpp_permute(k, n_kv)),
        ("blk.0.attn_v.weight", v),
        ("rope_freqs.weight", np.ones(3, np.float32)),
    ]
    out = gguf_to_hf_tensors(gguf, n_head=n_head, n_kv_head=n_kv)
    assert set(out) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    }
    np.testing.assert_array_equal(
        out["model.layers.0.self_attn.q_proj.weight"], q.astype(np.float16)
    )
    np.testing.assert_array_equal(
        out["model.layers.0.self_attn.k_proj.weight"], k.astype(np.float16)
    )
    np.testing.assert_array_equal(
        out["model.layers.0.self_attn.v_proj.weight"], v.astype(np.float16)
    )
