"""The llama.cpp engine on the bundled model: what the contract suite cannot check.

Determinism under batching, the sampling mapping, logprobs, KV-cache exhaustion and
prefill chunking, all against the real SmolLM2-135M GGUF on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.chat_template import PromptBuilder
from app.messages import EngineFinish
from app.model_card import ModelCard
from app.records import SamplingParams
from app.settings import Settings
from tests.engines.test_contract import PROMPT, Choice, Run, advance, make_llamacpp
from workers.engines.base import ChoiceJob, EngineJob, JobRejected
from workers.engines.llamacpp import KV_FULL_MESSAGE, LlamaCppEngine, choice_seed
from workers.engines.llamacpp_load import cpu_has_amx

GREEDY = SamplingParams(temperature=0.0)
OTHER_PROMPTS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three colours."}],
    [{"role": "user", "content": "Explain recursion to a child in simple words."}],
]


@pytest.fixture
def engine(bundled_model_dir: Path) -> Iterator[LlamaCppEngine]:
    built = make_llamacpp(bundled_model_dir)
    assert isinstance(built, LlamaCppEngine)
    yield built
    built.close()


def run_jobs(engine: LlamaCppEngine, *jobs: EngineJob) -> Run:
    for j in jobs:
        engine.submit(j)
    run = advance(engine, Run())
    assert not engine.has_work()
    # Every sequence is given back once the jobs are over; the KV cells they leave are
    # the prefix cache's, exactly as llama.cpp holds them.
    assert engine.running_sequences == 0 and engine.kv_pinned == 0
    engine.check_kv()
    return run


def one(job_id: str, prompt: list[int], max_new: int, **kwargs: object) -> EngineJob:
    kwargs.setdefault("sampling", GREEDY)
    return EngineJob(job_id, prompt, [ChoiceJob(0, max_new)], **kwargs)  # type: ignore[arg-type]


def test_greedy_is_deterministic_alone_and_batched(
    engine: LlamaCppEngine, builder: PromptBuilder
) -> None:
    first = run_jobs(engine, one("a", PROMPT, 24))["a", 0].tokens
    again = run_jobs(engine, one("a", PROMPT, 24))["a", 0].tokens
    others = [one(f"o{i}", builder.encode_chat(m), 24) for i, m in enumerate(OTHER_PROMPTS)]
    batched = run_jobs(engine, *others, one("a", PROMPT, 24), one("b", PROMPT, 24))
    assert first == again == batched["a", 0].tokens == batched["b", 0].tokens


def test_batched_output_equals_output_alone(engine: LlamaCppEngine, builder: PromptBuilder) -> None:
    prompts = [builder.encode_chat(m) for m in OTHER_PROMPTS]
    alone = [run_jobs(engine, one("x", p, 20))["x", 0].tokens for p in prompts]
    # Staggered arrivals: each joins while the previous ones are mid-generation.
    run = Run()
    for i, p in enumerate(prompts):
        engine.submit(one(f"j{i}", p, 20))
        advance(engine, run, steps=3)
    advance(engine, run)
    assert [run[f"j{i}", 0].tokens for i in range(len(prompts))] == alone


def test_greedy_answer_mentions_paris(
    engine: LlamaCppEngine, builder: PromptBuilder, card: ModelCard
) -> None:
    # With the template's default system prompt this 135M Q4_1 model rambles in French
    # (llama-cpp-python's own Llama.generate does the same); a plain system prompt
    # gets the answer.
    ids = builder.encode_chat(
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
    )
    eos = frozenset(card.eos_token_ids)
    c = run_jobs(engine, one("q", ids, 30, eos_token_ids=eos))["q", 0]
    assert "Paris" in builder.tokenizer.decode(c.tokens)
    assert c.finishes == [EngineFinish.EOS] and c.tokens[-1] in eos


def test_greedy_argmax_picks_what_the_greedy_chain_picks(
    engine: LlamaCppEngine, builder: PromptBuilder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plain greedy jobs skip llama_sampler_sample and argmax the logits row; the tokens
    # must be those of the chain, batched, with the min_tokens mask and with logprobs.
    from workers.engines import llamacpp

    prompts = [PROMPT, *(builder.encode_chat(m) for m in OTHER_PROMPTS)]
    stops = frozenset({2})

    def jobs() -> list[EngineJob]:
        made = [one(f"j{i}", p, 24) for i, p in enumerate(prompts)]
        made.append(one("m", PROMPT, 12, eos_token_ids=stops, min_tokens=8))
        made.append(one("l", PROMPT, 12, sampling=SamplingParams(temperature=0.0, logprobs=2)))
        return made

    engine.submit(one("probe", PROMPT, 1))
    assert engine._jobs["probe"].greedy  # the fast path is the one under test
    run_jobs(engine)
    fast = run_jobs(engine, *jobs())
    monkeypatch.setattr(llamacpp, "plain_greedy", lambda sp: False)
    chained = run_jobs(engine, *jobs())
    assert fast.choices.keys() == chained.choices.keys()
    for key, c in fast.choices.items():
        assert c.tokens == chained[key].tokens, key
        assert c.finishes == chained[key].finishes, key


def test_plain_greedy_only_without_transforms() -> None:
    from workers.engines.llamacpp_sampling import plain_greedy

    assert plain_greedy(SamplingParams(temperature=0.0))
    assert plain_greedy(SamplingParams(temperature=0.0, logprobs=3, seed=7))
    assert not plain_greedy(SamplingParams(temperature=0.7))
    assert not plain_greedy(SamplingParams(temperature=0.0, logit_bias={5: 10.0}))
    assert not plain_greedy(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert not plain_greedy(SamplingParams(temperature=0.0, frequency_penalty=0.5))
    assert not plain_greedy(SamplingParams(temperature=0.0, presence_penalty=0.5))


def test_min_tokens_masks_stop_ids(engine: LlamaCppEngine) -> None:
    greedy = run_jobs(engine, one("g", PROMPT, 1))["g", 0].tokens
    stops = frozenset({greedy[0], 2})
    c = run_jobs(engine, one("m", PROMPT, 6, eos_token_ids=stops, min_tokens=5))["m", 0]
    assert not stops & set(c.tokens[:5])


def test_sampling_filters_that_keep_one_token_equal_greedy(engine: LlamaCppEngine) -> None:
    greedy = run_jobs(engine, one("g", PROMPT, 12))["g", 0].tokens
    for sp in (
        SamplingParams(temperature=1.0, top_k=1, seed=7),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=7),
        SamplingParams(temperature=1.0, min_p=1.0, seed=7),
    ):
        assert run_jobs(engine, one("s", PROMPT, 12, sampling=sp))["s", 0].tokens == greedy, sp


def test_penalties_change_greedy_output(engine: LlamaCppEngine) -> None:
    greedy = run_jobs(engine, one("g", PROMPT, 30))["g", 0].tokens
    for sp in (
        SamplingParams(temperature=0.0, presence_penalty=2.0),
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
    ):
        out = run_jobs(engine, one("p", PROMPT, 30, sampling=sp))["p", 0].tokens
        assert out != greedy, sp
        # A strong penalty on repeats leaves fewer repeated tokens than greedy.
        assert len(out) - len(set(out)) <= len(greedy) - len(set(greedy)), sp


def test_logit_bias_forces_and_bans(engine: LlamaCppEngine) -> None:
    forced = 4649  # " France"
    sp = SamplingParams(temperature=1.0, seed=3, logit_bias={forced: 100.0}, logprobs=1)
    c = run_jobs(engine, one("f", PROMPT, 5, sampling=sp))["f", 0]
    assert c.tokens == [forced] * 5
    # Logprobs are the model's own (before the bias): not a near-certain 0.0.
    assert c.logprobs[0].logprob < -1.0
    first = run_jobs(engine, one("g", PROMPT, 1))["g", 0].tokens[0]
    banned = SamplingParams(temperature=0.0, logit_bias={first: -100.0})
    assert run_jobs(engine, one("b", PROMPT, 1, sampling=banned))["b", 0].tokens[0] != first


def test_seed_reproducibility_and_choice_seeds(engine: LlamaCppEngine) -> None:
    def sample(seed: int | None, n: int = 1) -> list[list[int]]:
        sp = SamplingParams(temperature=1.0, seed=seed)
        j = EngineJob("s", list(PROMPT), [ChoiceJob(i, 16) for i in range(n)], sp)
        run = run_jobs(engine, j)
        return [run["s", i].tokens for i in range(n)]

    assert sample(42) == sample(42)
    assert sample(42) != sample(43)
    pair = sample(42, n=2)
    assert pair[0] != pair[1]
    assert pair == [sample(42)[0], sample(43)[0]]  # choice i uses seed + i
    assert choice_seed(SamplingParams(seed=None), 0) == 0xFFFFFFFF  # llama.cpp draws one
    assert choice_seed(SamplingParams(seed=-1), 0) == 0xFFFFFFFE


def test_logprobs_are_a_distribution(engine: LlamaCppEngine) -> None:
    sp = SamplingParams(temperature=0.0, logprobs=5)
    c = run_jobs(engine, one("l", PROMPT, 6, sampling=sp))["l", 0]
    for tok, lp in zip(c.tokens, c.logprobs, strict=True):
        ids = [t for t, _ in lp.top]
        values = [v for _, v in lp.top]
        assert ids[0] == tok  # greedy picks the most likely token
        assert math.isclose(lp.logprob, values[0], abs_tol=1e-6)
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
    sp0 = SamplingParams(temperature=0.0, logprobs=0)
    c0 = run_jobs(engine, one("z", PROMPT, 2, sampling=sp0))["z", 0]
    assert all(lp.top == [] for lp in c0.logprobs)


def test_n_choices_share_one_prompt_prefill(engine: LlamaCppEngine) -> None:
    sp = SamplingParams(temperature=0.0)
    j = EngineJob("n", list(PROMPT), [ChoiceJob(i, 8) for i in range(3)], sp)
    engine.submit(j)
    run = Run()
    advance(engine, run, steps=1)  # one step: the prompt once, for all three sequences
    assert all(len(run["n", i].tokens) == 1 for i in range(3))
    assert engine.kv_pinned == len(PROMPT)
    advance(engine, run)
    assert run["n", 0].tokens == run["n", 1].tokens == run["n", 2].tokens


def test_long_prompt_is_prefilled_in_chunks(bundled_model_dir: Path) -> None:
    engine = make_llamacpp(bundled_model_dir, prefill_chunk=16)
    try:
        engine.submit(one("short", PROMPT, 40))
        run = advance(engine, Run(), steps=1)
        engine.submit(one("long", PROMPT * 8, 3))  # 136 tokens: 9 chunks of 16
        for _ in range(5):
            before = len(run["short", 0].tokens)
            advance(engine, run, steps=1)
            assert len(run["short", 0].tokens) == before + 1  # never stalled
        assert ("long", 0) not in run.choices  # still prefilling
        advance(engine, run)
        assert len(run["long", 0].tokens) == 3
    finally:
        engine.close()


def test_kv_cache_exhaustion_fails_only_one_job_the_newest_among_equals(
    bundled_model_dir: Path,
) -> None:
    engine = make_llamacpp(bundled_model_dir, n_ctx=256, capacity=4)
    try:
        jobs = [one(f"j{i}", PROMPT, 200) for i in range(3)]  # each fits; together not
        run = Run()
        for j in jobs:
            engine.submit(j)
        advance(engine, run)
        finishes = {k: c.finishes for k, c in run.choices.items()}
        assert all(len(f) == 1 for f in finishes.values())
        assert finishes["j0", 0] == [EngineFinish.LENGTH]
        assert EngineFinish.ERROR in {f[0] for f in finishes.values()}
        assert not engine.has_work() and engine.kv_pinned == 0
    finally:
        engine.close()


def test_kv_cache_exhaustion_fails_the_job_holding_most_not_a_small_newcomer(
    bundled_model_dir: Path,
) -> None:
    """Issue 47, finding 2: one request whose choices grow into the whole cache made
    other clients' small requests fail with "out of KV cache". The job holding the most
    cells ends now, with a capacity error (503, retry), and the small one finishes."""
    engine = make_llamacpp(bundled_model_dir, n_ctx=256, capacity=4)
    rare = frozenset({49000})  # a stop id it will not sample: it runs to max_new
    try:
        hog = EngineJob("hog", PROMPT, [ChoiceJob(i, 100) for i in range(3)], GREEDY, rare)
        engine.submit(hog)
        run = Run()
        advance(engine, run, steps=30)  # the hog holds ~17 + 3 x 30 cells
        engine.submit(one("small", PROMPT, 40))
        errors: dict[str, set[int | None]] = {}
        for _ in range(400):
            if not engine.has_work():
                break
            for st in engine.step():
                d = st.delta
                if d.finish is EngineFinish.ERROR:
                    errors.setdefault(st.job_id, set()).add(d.error_code)
                ch = run.choices.setdefault((st.job_id, d.choice), Choice())
                ch.tokens += d.token_ids
                if d.finish is not None:
                    ch.finishes.append(d.finish)
        assert errors == {"hog": {503}}
        assert run["small", 0].finishes == [EngineFinish.LENGTH]
        assert len(run["small", 0].tokens) == 40
        assert not engine.has_work() and engine.kv_pinned == 0
        engine.check_kv()
    finally:
        engine.close()


def test_a_job_that_cannot_fit_with_ignore_eos_is_refused_up_front(
    engine: LlamaCppEngine,
) -> None:
    """Nothing can end it early, so it would hold prompt + n x max_tokens cells: more
    than the cache is a 400 at submit, not a cache taken from everyone until it fails."""
    choices = [ChoiceJob(i, 1000) for i in range(8)]  # 8 x 1000 > 2048 cells
    with pytest.raises(JobRejected, match="ignore_eos"):
        engine.submit(EngineJob("big", PROMPT, choices, GREEDY))
    ok = run_jobs(engine, EngineJob("ok", PROMPT, [ChoiceJob(0, 8)], GREEDY))  # still serving
    assert ok["ok", 0].finishes == [EngineFinish.LENGTH]


def test_kv_full_error_message_is_client_safe() -> None:
    assert "KV cache" in KV_FULL_MESSAGE and "/" not in KV_FULL_MESSAGE


def test_rejections_name_the_numbers(engine: LlamaCppEngine) -> None:
    with pytest.raises(JobRejected, match=r"prompt \(17 tokens\) \+ max_tokens \(5000\)"):
        engine.submit(one("big", PROMPT, 5000))
    with pytest.raises(JobRejected, match="empty"):
        engine.submit(one("empty", [], 5))
    with pytest.raises(JobRejected, match="token ids"):
        engine.submit(one("bad", [1, 10**6], 5))
    too_many = EngineJob("n", list(PROMPT), [ChoiceJob(i, 1) for i in range(9)])
    with pytest.raises(JobRejected, match="n=9"):
        engine.submit(too_many)
    assert not engine.has_work()


def test_zero_max_new_tokens_finishes_without_tokens(engine: LlamaCppEngine) -> None:
    j = EngineJob("z", list(PROMPT), [ChoiceJob(0, 0, prefix_ids=[28]), ChoiceJob(1, 2)])
    run = run_jobs(engine, j)
    assert run["z", 0].tokens == [] and run["z", 0].finishes == [EngineFinish.LENGTH]
    assert len(run["z", 1].tokens) == 2


def test_extra_buffers_are_off_on_amx_cpus_unless_asked_for(
    bundled_model_dir: Path, card: ModelCard, tmp_path: Path
) -> None:
    """ggml's AMX matmul segfaults on batched decodes in this llama.cpp (every batched
    test crashed on an AMX machine): AMX CPUs run without the extra buffers."""
    amx, plain = tmp_path / "amx", tmp_path / "plain"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_int8 amx_tile\n")
    plain.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert cpu_has_amx(amx) and not cpu_has_amx(plain)
    assert not cpu_has_amx(tmp_path / "missing")
    engine = LlamaCppEngine.from_card(card, Settings(llamacpp_extra_buffers=False, worker_slots=2))
    try:
        assert engine.extra_buffers is False
        assert len(run_jobs(engine, one("a", PROMPT, 3))["a", 0].tokens) == 3
    finally:
        engine.close()


def test_from_card_uses_settings(bundled_model_dir: Path, card: ModelCard) -> None:
    settings = Settings(llamacpp_threads=2, llamacpp_n_ctx=1024, worker_slots=3, max_n=2)
    engine = LlamaCppEngine.from_card(card, settings)
    try:
        assert engine.n_ctx == 1024
        assert engine.context_limit == 1024
        assert engine.hot_cells == 512 and engine.prefix_cache
        assert 3 <= engine.capacity <= 64
        c = run_jobs(engine, one("a", PROMPT, 3))["a", 0]
        assert len(c.tokens) == 3
    finally:
        engine.close()


def test_stats_report_cache_usage_while_running(engine: LlamaCppEngine) -> None:
    """The worker heartbeat exports this as tokenrelay_worker_cache_usage."""
    from tests.engines.test_contract import job

    assert engine.stats()["cache_usage"] == 0.0
    engine.submit(job("stats", 4))
    engine.step()
    assert 0.0 < engine.stats()["cache_usage"] < 1.0
    while engine.has_work():
        engine.step()
    # What the job leaves is the prefix cache's: free to take, so not "in use".
    stats = engine.stats()
    assert stats["cache_usage"] == 0.0
    assert stats["prefix_cache_cells"] == len(PROMPT) + 3
    assert stats["prefix_cache_queries"] == len(PROMPT)
