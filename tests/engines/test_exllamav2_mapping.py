"""The exllamav2 engine's mapping layer, run against stand-ins (no GPU, no torch here).

``StandInDynamicGenerator``, ``StandInJob`` and ``StandInSettings`` are stand-ins below
the engine interface: they copy the exact exllamav2 0.3.2 surface the engine uses
(``ExLlamaV2DynamicGenerator.enqueue/iterate/cancel/num_remaining_jobs`` and its limit
attributes, the ``ExLlamaV2DynamicJob`` constructor, ``ExLlamaV2Sampler.Settings`` with
its non-neutral defaults) and play scripted ``iterate()`` result dicts shaped like the
real ones (dynamic.py:916-985, 2005-2099). Unlike the real job class they refuse unknown
keyword arguments, so a misspelt argument fails here instead of being swallowed by the
real constructor's ``**kwargs``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest

from app.messages import EngineFinish, SamplingParams
from workers.engines.base import ChoiceJob, EngineJob, EngineStep, JobRejected
from workers.engines.exllamav2 import (
    NEUTRAL_SETTINGS,
    ExllamaApi,
    ExLlamaV2Engine,
    logprobs_from_logits,
)

VOCAB = 100
PADDED_VOCAB = 128  # ((100 + 31) // 32) * 32, as dynamic.py:333 pads it

# ExLlamaV2Sampler.Settings defaults in 0.3.2 (sampler.py:52-100), the fields we touch.
EXL_DEFAULTS: dict[str, Any] = {
    "token_repetition_penalty": 1.025,
    "token_repetition_range": -1,
    "token_repetition_decay": 0,
    "token_frequency_penalty": 0.0,
    "token_presence_penalty": 0.0,
    "temperature": 0.8,
    "smoothing_factor": 0.0,
    "min_temp": 0,
    "max_temp": 0.0,
    "temp_exponent": 1.0,
    "top_k": 50,
    "top_p": 0.8,
    "top_a": 0.0,
    "min_p": 0,
    "tfs": 0,
    "typical": 0,
    "skew": 0,
    "temperature_last": False,
    "mirostat": False,
    "token_bias": None,
    "cfg_scale": None,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
}


class StandInSettings:
    """Stand-in for ``ExLlamaV2Sampler.Settings``: a dataclass with 0.3.2's defaults."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EXL_DEFAULTS)
        if unknown:
            raise TypeError(f"unexpected Settings fields {unknown}")
        self.__dict__.update(EXL_DEFAULTS)
        self.__dict__.update(kwargs)


class StandInJob:
    """Stand-in for ``ExLlamaV2DynamicJob``: 0.3.2's constructor, minus ``**kwargs``."""

    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        max_skips: int | None = 4,
        gen_settings: StandInSettings | None = None,
        seed: int | None = None,
        stop_conditions: list[Any] | None = None,
        decode_special_tokens: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        return_probs: bool = False,
        filters: list[Any] | None = None,
        filter_prefer_eos: bool = False,
        token_healing: bool = False,
        identifier: object | None = None,
        banned_strings: list[str] | None = None,
        embeddings: list[Any] | None = None,
    ) -> None:
        assert input_ids.shape[0] == 1 and input_ids.shape[-1] > 0  # dynamic.py:1718-1721
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.gen_settings = gen_settings if gen_settings is not None else StandInSettings()
        self.seed = seed
        self.stop_conditions = stop_conditions
        self.return_top_tokens = return_top_tokens
        self.return_logits = return_logits
        self.return_probs = return_probs
        self.token_healing = token_healing
        self.identifier = identifier
        self.banned_strings = banned_strings
        self.filters = filters if filters is not None else []
        self.filter_prefer_eos = filter_prefer_eos
        self.serial_number: int | None = None


def toks(ids: list[int]) -> np.ndarray:
    """A (1, n) id tensor, as results carry them (SeqTensor((1, 0)).torch())."""
    return np.array([ids], dtype=np.int64)


def stream(ids: list[int], logits: np.ndarray | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {"eos": False, "token_ids": toks(ids)}
    if logits is not None:
        r["logits"] = logits
    return r


def held_back() -> dict[str, Any]:
    """exllamav2 holding output (incomplete UTF-8): a streaming result without ids."""
    return {"eos": False}


def stop_token(held: list[int], logits: np.ndarray | None = None) -> dict[str, Any]:
    """An EOS on a stop token: no flush, the held ids (stop token last) under "held"."""
    h: dict[str, Any] = {"token_ids": toks(held)}
    if logits is not None:
        h["logits"] = logits
    return {
        "eos": True,
        "eos_reason": "stop_token",
        "eos_triggering_token_id": held[-1],
        "held": h,
        "new_tokens": 9,
        "cached_tokens": 256,
    }


def max_tokens(ids: list[int]) -> dict[str, Any]:
    """max_new_tokens: the held ids are flushed into token_ids, "held" stays empty."""
    return {"eos": True, "eos_reason": "max_new_tokens", "token_ids": toks(ids), "cached_tokens": 0}


class StandInDynamicGenerator:
    """Stand-in for ``ExLlamaV2DynamicGenerator`` playing scripted results per job."""

    def __init__(
        self,
        *,
        cache_tokens: int = 4096,
        max_seq_len: int = 8192,
        max_batch_size: int = 8,
        paged: bool = True,
    ) -> None:
        self.max_total_tokens = cache_tokens
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.paged = paged
        self.padded_vocab_size = PADDED_VOCAB
        self.pending_jobs: list[StandInJob] = []
        self.active_jobs: list[StandInJob] = []
        self.enqueued: list[StandInJob] = []
        self.cancelled: list[StandInJob] = []
        self.scripts: dict[Any, deque[dict[str, Any]]] = {}
        self.refuse: set[Any] = set()
        self.iterations = 0
        self._serial = 0

    def script(self, identifier: Any, *results: dict[str, Any]) -> None:
        self.scripts[identifier] = deque(results)

    def enqueue(self, job: StandInJob) -> int:
        if job.identifier in self.refuse:
            raise RuntimeError("refused")
        pages = -(-(job.input_ids.shape[-1] + job.max_new_tokens) // 256)
        assert pages <= self.max_total_tokens // 256, "Job requires ... pages"  # dyn:2285
        job.serial_number = self._serial
        self._serial += 1
        self.pending_jobs.append(job)
        self.enqueued.append(job)
        return job.serial_number

    def cancel(self, job: StandInJob) -> None:
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            self.active_jobs.remove(job)
        self.cancelled.append(job)

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def iterate(self) -> list[dict[str, Any]]:
        self.iterations += 1
        results: list[dict[str, Any]] = []
        while self.pending_jobs and len(self.active_jobs) < self.max_batch_size:
            job = self.pending_jobs.pop(0)
            self.active_jobs.append(job)
            results.append(self._result(job, {"stage": "started", "eos": False}))
        for job in list(self.active_jobs):
            r = self.scripts[job.identifier].popleft()
            results.append(self._result(job, {"stage": "streaming", **r}))
            if r.get("eos"):
                self.active_jobs.remove(job)
        return results

    @staticmethod
    def _result(job: StandInJob, r: dict[str, Any]) -> dict[str, Any]:
        r = {"job": job, "serial": job.serial_number, **r}
        if job.identifier is not None:
            r["identifier"] = job.identifier
        return r


def stand_in_api() -> ExllamaApi:
    def token_bias(size: int, bias: dict[int, float]) -> np.ndarray:
        t = np.zeros((size,), dtype=np.float32)
        for tok, value in bias.items():
            t[tok] = value
        return t

    return ExllamaApi(
        job_cls=StandInJob,
        settings_cls=StandInSettings,
        input_ids=lambda ids: np.array([ids], dtype=np.int64),
        token_bias=token_bias,
    )


def make_engine(**gen: Any) -> tuple[ExLlamaV2Engine, StandInDynamicGenerator]:
    generator = StandInDynamicGenerator(**gen)
    return ExLlamaV2Engine(generator, vocab_size=VOCAB, api=stand_in_api()), generator


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
    assert (s.token_presence_penalty, s.token_frequency_penalty) == (0.5, -0.25)
    assert s.token_repetition_penalty == 1.1
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
    engine.submit(make_job("a", n=2))
    engine.submit(make_job("b"))
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
    engine.submit(make_job(n=2))
    gen.script(("j1", 0), max_tokens([5]))
    gen.script(("j1", 1), stream([6]), stream([7]))
    engine.step()
    engine.cancel("j1")
    assert [j.identifier for j in gen.cancelled] == [("j1", 1)]
    assert [(s.delta.choice, s.delta.finish) for s in engine.step()] == [
        (1, EngineFinish.CANCELLED)
    ]


def test_a_job_that_can_never_fit_the_cache_is_rejected_up_front() -> None:
    engine, gen = make_engine(cache_tokens=1024)
    with pytest.raises(JobRejected) as exc:
        engine.submit(make_job(prompt=list(range(1, 11)) * 100, max_new_tokens=25))
    assert (
        str(exc.value) == "prompt (1000 tokens) + max_tokens (25) exceeds the cache (1024 tokens)"
    )
    assert gen.enqueued == [] and not engine.has_work()
    engine.submit(make_job(prompt=list(range(1, 11)) * 100, max_new_tokens=24))  # fits exactly


def test_a_resumed_prefix_counts_towards_the_cache_limit() -> None:
    engine, _ = make_engine(cache_tokens=256)
    with pytest.raises(JobRejected, match=r"prompt \(254 tokens\) \+ max_tokens \(3\)"):
        engine.submit(make_job(prompt=[1] * 250, choices=[ChoiceJob(0, 3, prefix_ids=[5] * 4)]))


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
    engine.submit(make_job(n=2))
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
    (lp,) = logprobs_from_logits(logits, [3], 0)
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
    from benchmarks.gpu_check import gguf_to_hf_tensors, hf_tensor_name

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
