"""One contract suite for every engine that runs on this machine (echo, llamacpp).

The ``Engine`` docstring (workers/engines/base.py) is the contract; each test below
checks one clause of it against every engine, so a new engine gets the same checks by
adding it to ``engine`` (as huey runs one ``StorageTests`` suite for each backend).
Expected tokens are learnt from the engine itself (a greedy run), never hard-coded, so
the same assertions hold for a model and for the echo engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from app.messages import EngineFinish, TokenLogprob
from app.records import SamplingParams
from workers.engines.base import ChoiceJob, Engine, EngineJob, JobRejected

GREEDY = SamplingParams(temperature=0.0)
# "<|im_start|>user\nHello there, how are you today?<|im_end|>\n<|im_start|>assistant\n"
# in the bundled tokenizer: a real chat prompt, whose first ids are distinct.
PROMPT = [1, 4093, 198, 19556, 665, 28, 638, 359, 346, 1834, 47, 2, 198, 1, 520, 9531, 198]


def make_llamacpp(model_dir: Path, **kwargs: object) -> Engine:
    from app.model_card import load_model_card
    from workers.engines.llamacpp import LlamaCppEngine

    card = load_model_card(model_dir)
    assert card.gguf_file is not None
    options: dict[str, object] = {"n_ctx": 2048, "n_threads": 2, "capacity": 8}
    options.update(kwargs)
    return LlamaCppEngine(card.path / card.gguf_file, **options)  # type: ignore[arg-type]


@pytest.fixture(params=["echo", "llamacpp"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    if request.param == "echo":
        from workers.engines.echo import EchoEngine

        built: Engine = EchoEngine(context_length=2048)
    else:
        built = make_llamacpp(request.getfixturevalue("bundled_model_dir"))
    yield built
    built.close()


@dataclass
class Choice:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finishes: list[EngineFinish] = field(default_factory=list)
    first_step: int | None = None
    had_logprobs: bool = False
    after_finish: int = 0  # deltas seen after the finish (must stay 0)
    cached: int | None = None  # the prompt tokens the engine said it took from a cache
    cached_first: int | None = None  # ... on the delta with the choice's first tokens


@dataclass
class Run:
    choices: dict[tuple[str, int], Choice] = field(default_factory=dict)
    steps: int = 0

    def __getitem__(self, key: tuple[str, int]) -> Choice:
        return self.choices[key]


def advance(engine: Engine, run: Run, steps: int = 10_000) -> Run:
    """Step ``engine`` up to ``steps`` times (or until idle), recording what it emits."""
    for _ in range(steps):
        if not engine.has_work():
            break
        run.steps += 1
        for st in engine.step():
            c = run.choices.setdefault((st.job_id, st.delta.choice), Choice())
            if c.finishes:
                c.after_finish += 1
            if st.delta.token_ids and c.first_step is None:
                c.first_step = run.steps
                c.cached_first = st.delta.cached_tokens
            c.tokens += st.delta.token_ids
            if st.delta.logprobs is not None:
                c.had_logprobs = True
                assert len(st.delta.logprobs) == len(st.delta.token_ids)
                c.logprobs += st.delta.logprobs
            if st.delta.finish is not None:
                c.finishes.append(st.delta.finish)
            if st.delta.cached_tokens is not None:
                c.cached = st.delta.cached_tokens
    return run


def job(job_id: str, max_new: int, n: int = 1, **kwargs: object) -> EngineJob:
    kwargs.setdefault("sampling", GREEDY)
    return EngineJob(
        job_id,
        list(PROMPT),
        [ChoiceJob(i, max_new) for i in range(n)],
        **kwargs,  # type: ignore[arg-type]
    )


def greedy_tokens(engine: Engine, max_new: int) -> list[int]:
    engine.submit(job("probe", max_new))
    return advance(engine, Run())["probe", 0].tokens


def test_every_choice_gets_exactly_one_finish(engine: Engine) -> None:
    jobs = [job("a", 3), job("b", 5, n=2), job("c", 1), job("d", 4, n=3)]
    for j in jobs:
        engine.submit(j)
    run = advance(engine, Run())
    assert not engine.has_work()
    expected = {(j.job_id, c.index) for j in jobs for c in j.choices}
    assert set(run.choices) == expected
    for c in run.choices.values():
        assert len(c.finishes) == 1
        assert c.after_finish == 0


def test_a_cache_count_comes_with_the_first_tokens(engine: Engine) -> None:
    """An engine that says how much of a prompt it took from a cache says it with the
    choice's first tokens: a stop string may end the choice in the streamer before the
    engine's finish comes, and the usage sent then must have the count."""
    engine.submit(job("a", 4, n=2))
    advance(engine, Run())
    engine.submit(job("b", 4, n=2))  # the same prompt again: a hit where there is a cache
    run = advance(engine, Run())
    for c in run.choices.values():
        assert c.cached_first == c.cached
    if engine.name == "llamacpp":
        assert all(c.cached and c.cached >= len(PROMPT) - 1 for c in run.choices.values())


def test_max_new_tokens_ends_with_length(engine: Engine) -> None:
    engine.submit(job("a", 7))
    c = advance(engine, Run())["a", 0]
    assert len(c.tokens) == 7
    assert c.finishes == [EngineFinish.LENGTH]


def test_n_choices_have_their_indices(engine: Engine) -> None:
    engine.submit(job("a", 4, n=3))
    run = advance(engine, Run())
    assert sorted(run.choices) == [("a", 0), ("a", 1), ("a", 2)]
    assert all(len(c.tokens) == 4 for c in run.choices.values())


def test_cancel_ends_at_next_step_with_no_more_tokens(engine: Engine) -> None:
    engine.submit(job("a", 50, n=2))
    engine.submit(job("b", 5))
    run = advance(engine, Run(), steps=3)
    before = {k: len(c.tokens) for k, c in run.choices.items()}
    engine.cancel("a")
    advance(engine, run, steps=1)
    for i in range(2):
        c = run["a", i]
        assert c.finishes == [EngineFinish.CANCELLED]
        assert len(c.tokens) == before.get(("a", i), 0)
    advance(engine, run)
    assert run["a", 0].after_finish == run["a", 1].after_finish == 0
    assert run["b", 0].finishes == [EngineFinish.LENGTH]
    assert not engine.has_work()


def test_cancel_before_any_step(engine: Engine) -> None:
    engine.submit(job("a", 5))
    engine.cancel("a")
    run = advance(engine, Run())
    assert run["a", 0].tokens == []
    assert run["a", 0].finishes == [EngineFinish.CANCELLED]


def test_unknown_cancel_is_ignored(engine: Engine) -> None:
    engine.cancel("nobody")
    engine.submit(job("a", 2))
    engine.cancel("nobody")
    assert advance(engine, Run())["a", 0].finishes == [EngineFinish.LENGTH]


def test_job_that_cannot_fit_is_rejected(engine: Engine) -> None:
    with pytest.raises(JobRejected, match=r"\d+ tokens"):
        engine.submit(job("a", 1_000_000))
    assert not engine.has_work()


def test_min_tokens_delays_eos(engine: Engine) -> None:
    first = greedy_tokens(engine, 1)[0]
    engine.submit(job("a", 10, eos_token_ids=frozenset({first}), min_tokens=4))
    c = advance(engine, Run())["a", 0]
    assert len(c.finishes) == 1
    if c.finishes == [EngineFinish.EOS]:
        assert len(c.tokens) > 4
        assert c.tokens[-1] == first
    else:
        assert c.finishes == [EngineFinish.LENGTH] and len(c.tokens) == 10


def test_resume_continues_after_prefix(engine: Engine) -> None:
    full = greedy_tokens(engine, 6)
    resumed = EngineJob("r", list(PROMPT), [ChoiceJob(0, 3, prefix_ids=full[:3])], GREEDY)
    engine.submit(resumed)
    c = advance(engine, Run())["r", 0]
    assert c.tokens == full[3:6]  # greedy engines continue exactly; only new ones count
    assert c.finishes == [EngineFinish.LENGTH]


def test_min_tokens_counts_the_resumed_prefix(engine: Engine) -> None:
    full = greedy_tokens(engine, 4)
    stop = full[3]
    resumed = EngineJob(
        "r",
        list(PROMPT),
        [ChoiceJob(0, 5, prefix_ids=full[:3])],
        GREEDY,
        stop_token_ids=frozenset({stop}),
        min_tokens=3,
    )
    engine.submit(resumed)
    c = advance(engine, Run())["r", 0]
    assert c.tokens == [stop]
    assert c.finishes == [EngineFinish.EOS]


def test_logprobs_aligned_when_asked(engine: Engine) -> None:
    engine.submit(job("a", 5, sampling=SamplingParams(temperature=0.0, logprobs=3)))
    engine.submit(job("b", 5))
    run = advance(engine, Run())
    a = run["a", 0]
    assert a.had_logprobs and len(a.logprobs) == len(a.tokens) == 5
    for tok, lp in zip(a.tokens, a.logprobs, strict=True):
        assert lp.token_id == tok
        assert lp.logprob <= 0.0
        assert len(lp.top) == 3
    assert not run["b", 0].had_logprobs


def test_stop_token_is_last_token_with_eos(engine: Engine) -> None:
    full = greedy_tokens(engine, 8)
    stop = full[2]
    cut = full.index(stop) + 1
    engine.submit(job("a", 8, stop_token_ids=frozenset({stop})))
    c = advance(engine, Run())["a", 0]
    assert c.tokens == full[:cut]
    assert c.tokens[-1] == stop
    assert c.finishes == [EngineFinish.EOS]


def test_concurrent_jobs_progress_together(engine: Engine) -> None:
    for i in range(4):
        engine.submit(job(f"j{i}", 30))
    run = advance(engine, Run(), steps=5)
    for i in range(4):
        c = run[f"j{i}", 0]
        assert c.tokens, f"job {i} produced nothing in 5 steps"
        assert not c.finishes  # nobody ran to completion before the others started
    advance(engine, run)
    assert all(len(run[f"j{i}", 0].tokens) == 30 for i in range(4))
