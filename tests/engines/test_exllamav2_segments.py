"""The exllamav2 engine's segments (bounded page reservation) and output-only penalties,
against the stand-in generator and its small model (tests/engines/exllamav2_standin.py).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import pytest
from tokenizers import Tokenizer

from app.messages import EngineFinish
from app.model_card import ModelCard
from app.records import OutputConstraint, SamplingParams
from app.settings import Settings
from tests.engines.exllamav2_standin import (
    PADDED_VOCAB,
    VOCAB,
    StandInDynamicGenerator,
    StandInJob,
    max_tokens,
    page_hashes,
    stand_in_api,
    stop_token,
    stream,
)
from tests.engines.test_exllamav2_mapping import make_engine, make_job, run_until_idle
from workers.engines.base import ChoiceJob, EngineStep
from workers.engines.constraint import GrammarVocab
from workers.engines.exllamav2 import ExLlamaV2Engine

pytestmark = pytest.mark.unit  # fakes only: no engine weights, no server

PROMPT = [1, 10, 11, 12]


def tokens_of(steps: list[EngineStep], choice: int = 0) -> list[int]:
    return [t for s in steps if s.delta.choice == choice for t in s.delta.token_ids]


def finishes(steps: list[EngineStep]) -> list[EngineFinish]:
    return [s.delta.finish for s in steps if s.delta.finish is not None]


# --- segments ------------------------------------------------------------------------


def test_a_long_generation_runs_as_bounded_segments_and_reports_one_finish() -> None:
    engine, gen = make_engine(segment_tokens=16)
    engine.submit(make_job(max_new_tokens=50, eos=frozenset(), stop=frozenset({2})))
    steps = run_until_idle(engine, limit=200)
    out = tokens_of(steps)
    assert len(out) == 50 and finishes(steps) == [EngineFinish.LENGTH]
    jobs = gen.enqueued
    assert [j.max_new_tokens for j in jobs] == [16, 16, 16, 2]
    done = 0
    for j in jobs:
        # Each segment continues from the prompt and everything reported before it.
        assert j.input_ids.tolist() == [[*PROMPT, *out[:done]]]
        assert j.identifier == ("j1", 0) and j.stop_conditions == [2]
        done += j.max_new_tokens
    assert not engine.has_work() and gen.num_remaining_jobs() == 0


def test_segment_tokens_zero_reserves_the_whole_max_tokens() -> None:
    engine, gen = make_engine(segment_tokens=0)
    engine.submit(make_job(max_new_tokens=50, eos=frozenset()))
    steps = run_until_idle(engine, limit=200)
    assert len(tokens_of(steps)) == 50 and [j.max_new_tokens for j in gen.enqueued] == [50]


def test_a_seeded_choice_samples_the_same_whatever_the_segments() -> None:
    outputs = []
    for segment in (0, 7, 16):
        engine, gen = make_engine(segment_tokens=segment)
        engine.submit(make_job(n=2, max_new_tokens=40, sampling=SamplingParams(seed=5)))
        steps = run_until_idle(engine, limit=200)
        outputs.append((tokens_of(steps, 0), tokens_of(steps, 1)))
        # One random generator per choice, handed from segment to segment.
        rngs = {id(j.rng) for j in gen.enqueued if j.identifier == ("j1", 0)}
        assert len(rngs) == 1
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0][0] != outputs[0][1]  # seed + index: distinct choices


def test_min_tokens_counts_every_segment_and_the_resumed_prefix() -> None:
    engine, gen = make_engine(segment_tokens=16)
    job = make_job(min_tokens=40, choices=[ChoiceJob(0, 100, prefix_ids=[20, 21])])
    gen.finish_at[("j1", 0)] = 0  # the stand-in model stops as soon as it may
    engine.submit(job)
    steps = run_until_idle(engine, limit=200)
    assert [j.min_new_tokens for j in gen.enqueued] == [38, 22, 6]
    assert len(tokens_of(steps)) == 39  # 38 blocked from stopping, then the stop token
    assert tokens_of(steps)[-1] == 2 and finishes(steps) == [EngineFinish.EOS]


def test_logprobs_cover_every_segment() -> None:
    engine, gen = make_engine(segment_tokens=8)
    engine.submit(make_job(max_new_tokens=20, sampling=SamplingParams(logprobs=2)))
    steps = run_until_idle(engine, limit=100)
    lps = [lp for s in steps for lp in (s.delta.logprobs or [])]
    assert [lp.token_id for lp in lps] == tokens_of(steps) and len(lps) == 20
    assert all(j.return_logits for j in gen.enqueued) and len(gen.enqueued) == 3


def test_the_first_segments_cached_tokens_are_reported_at_the_finish() -> None:
    engine, gen = make_engine(segment_tokens=2)
    prompt = [3 + i % 90 for i in range(600)]
    gen.cached_pages.update(page_hashes(prompt))  # its first 2 pages: 512 tokens cached
    engine.submit(make_job(prompt=prompt, max_new_tokens=10))
    gen.script(
        ("j1", 0),
        stream([30]),
        max_tokens([31], cached_tokens=512),
        stream([32]),
        max_tokens([33], cached_tokens=768),  # the re-prefill's hits: not the prompt's
        stop_token([2]),
    )
    steps = run_until_idle(engine)
    assert tokens_of(steps) == [30, 31, 32, 33, 2]
    assert [(s.delta.finish, s.delta.cached_tokens) for s in steps if s.delta.finish] == [
        (EngineFinish.EOS, 512)
    ]
    # The count comes with the first token too (a stop string may end the choice in
    # the streamer before the finish comes), read from the job: the same 512.
    assert [s.delta.cached_tokens for s in steps[:-1]] == [512, None, None, None]


def test_cancel_between_segments_cancels_the_continuation() -> None:
    engine, gen = make_engine(segment_tokens=4, max_batch_size=1)
    engine.submit(make_job("a", max_new_tokens=12))
    engine.submit(make_job("b", max_new_tokens=4))
    for _ in range(4):
        engine.step()  # a's first segment ends; its continuation is queued before b
    assert [j.identifier for j in gen.pending_jobs] == [("a", 0), ("b", 0)]
    continuation = gen.pending_jobs[0]
    assert continuation is gen.enqueued[-1] and continuation.input_ids.shape[-1] == 8
    engine.cancel("a")
    assert gen.cancelled == [continuation]
    steps = engine.step()
    assert [(s.job_id, s.delta.finish) for s in steps if s.delta.finish] == [
        ("a", EngineFinish.CANCELLED)
    ]
    run_until_idle(engine)


def test_a_refused_continuation_errors_that_choice_in_the_same_delta() -> None:
    engine, gen = make_engine(segment_tokens=2)
    engine.submit(make_job(max_new_tokens=10))
    engine.step()
    gen.refuse.add(("j1", 0))
    steps = run_until_idle(engine)
    assert [(len(s.delta.token_ids), s.delta.finish) for s in steps] == [(1, EngineFinish.ERROR)]


def test_a_grammar_carries_across_segments(smollm_tokenizer: Tokenizer) -> None:
    vocab = GrammarVocab(llguidance.LLTokenizer(smollm_tokenizer.to_str(), eos_token=[2]))
    gen = StandInDynamicGenerator(max_batch_size=4)
    gen.padded_vocab_size = 49152
    engine = ExLlamaV2Engine(
        gen,
        vocab_size=vocab.size,
        api=stand_in_api(),
        grammar_vocab=lambda: vocab,
        segment_tokens=8,
    )
    c = OutputConstraint(kind="json_object")
    engine.submit(make_job(n=2, max_new_tokens=60, sampling=SamplingParams(constraint=c, seed=3)))
    steps = run_until_idle(engine, limit=200)
    for i in (0, 1):
        ids = tokens_of(steps, i)
        assert ids[-1] == 2
        json.loads(smollm_tokenizer.decode(ids, skip_special_tokens=True))
        segments = [j for j in gen.enqueued if j.identifier == ("j1", i)]
        assert len(segments) > 1, "the output should span several segments"
        assert len({id(j.filters[0]) for j in segments}) == 1
    assert finishes(steps) == [EngineFinish.EOS, EngineFinish.EOS]


# --- pages: what the cache admits ----------------------------------------------------------


def run_mix(segment_tokens: int, *, requests: int = 64) -> dict[str, int]:
    """``requests`` chat requests without max_tokens on a 32k-context model with the
    default 65,536-token cache and batch 256: prompts of 1,000 tokens, answers of 100 to
    ~1,500 tokens. Returns the most sequences running at once, the generator steps to
    finish them all, the prompt tokens prefilled, and the continuations."""
    context, prompt_len = 32768, 1000
    gen = StandInDynamicGenerator(cache_tokens=65536, max_seq_len=context, max_batch_size=256)
    engine = ExLlamaV2Engine(
        gen, vocab_size=VOCAB, api=stand_in_api(), segment_tokens=segment_tokens
    )
    for i in range(requests):
        prompt = [1 + (i + k) % 90 for k in range(prompt_len)]
        job = make_job(f"r{i}", prompt=prompt, max_new_tokens=context - prompt_len)
        gen.finish_at[(f"r{i}", 0)] = prompt_len + 100 + (i * 347) % 1400
        engine.submit(job)
    steps = run_until_idle(engine, limit=100_000)
    assert finishes(steps) == [EngineFinish.EOS] * requests
    return {
        "peak": gen.peak_active,
        "steps": gen.iterations,
        "prefilled": gen.prefilled_tokens,
        "continuations": len(gen.enqueued) - requests,
    }


def test_segments_let_the_cache_hold_as_many_sequences_as_their_length_allows() -> None:
    # The numbers docs/architecture.md quotes ("Page reservation").
    before = run_mix(0)
    after = run_mix(512)
    print(f"segment 0: {before}\nsegment 512: {after}")
    assert before["peak"] == 2  # 32,768 tokens reserved each: 128 of the 256 pages
    assert after["peak"] >= 40  # 6 pages each at start (1,000 + 512 tokens)
    assert after["steps"] * 10 < before["steps"]
    # A continuation re-prefills at most its partial last page: full pages are reused.
    assert before["continuations"] == 0 and after["continuations"] > 0
    assert after["prefilled"] - before["prefilled"] < after["continuations"] * 256


# --- presence / frequency penalties ---------------------------------------------------------


def reference(
    logits: Callable[[list[int]], np.ndarray],
    prompt: list[int],
    prefix: list[int],
    n: int,
    presence: float,
    frequency: float,
) -> list[int]:
    """Greedy decoding with OpenAI's penalties over generated tokens (prefix included)."""
    generated = list(prefix)
    out: list[int] = []
    for _ in range(n):
        row = logits([*prompt, *generated]).astype(np.float64)
        counts = np.bincount(generated, minlength=VOCAB)[:VOCAB]
        row -= frequency * counts + presence * (counts > 0)
        tok = int(np.argmax(row))
        second = np.partition(row, -2)[-2]
        assert row[tok] - second > 1e-3, "a near tie: float32 could pick either"
        generated.append(tok)
        out.append(tok)
    return out


def ladder(_ids: list[int]) -> np.ndarray:
    """Token 7 best, then 8, 9, ... by a margin of 0.5 each."""
    row = np.full(VOCAB, -50.0, dtype=np.float32)
    row[7:20] = -0.5 * np.arange(13)
    return row


@pytest.mark.parametrize("hold", [False, True], ids=["plain", "held-back"])
def test_presence_and_frequency_penalties_count_generated_tokens_only(hold: bool) -> None:
    gen = StandInDynamicGenerator(logits=ladder)
    if hold:
        gen.hold_ids = {7, 8}  # held back like an incomplete UTF-8 character
    engine = ExLlamaV2Engine(gen, vocab_size=VOCAB, api=stand_in_api(), segment_tokens=8)
    prompt = [1, *([7] * 400)]  # the prompt says 7 four hundred times: not counted
    sampling = SamplingParams(temperature=0.0, frequency_penalty=0.37, presence_penalty=0.23)
    choices = [ChoiceJob(0, 30, prefix_ids=[8, 8]), ChoiceJob(1, 30)]
    engine.submit(make_job(prompt=prompt, choices=choices, sampling=sampling, eos=frozenset()))
    steps = run_until_idle(engine, limit=200)
    for index, prefix in ((0, [8, 8]), (1, [])):
        want = reference(ladder, prompt, prefix, 30, presence=0.23, frequency=0.37)
        assert tokens_of(steps, index) == want
    assert tokens_of(steps, 1)[0] == 7  # without the fix, 7 was banned by the prompt
    bias = gen.enqueued[0].gen_settings.token_bias
    assert bias.shape == (PADDED_VOCAB,)


def test_only_choices_with_a_penalty_get_their_own_bias_tensor() -> None:
    engine, gen = make_engine()
    engine.submit(make_job("plain", n=2))
    engine.submit(make_job("biased", n=2, sampling=SamplingParams(logit_bias={5: 1.0})))
    pen = SamplingParams(logit_bias={5: 1.0}, presence_penalty=0.5)
    engine.submit(make_job("penalized", n=2, sampling=pen))
    by: dict[str, list[StandInJob]] = {}
    for j in gen.enqueued:
        by.setdefault(j.identifier[0], []).append(j)
    assert [j.gen_settings.token_bias for j in by["plain"]] == [None, None]
    a, b = (j.gen_settings.token_bias for j in by["biased"])
    assert a is b and a[5] == 1.0
    c, d = (j.gen_settings.token_bias for j in by["penalized"])
    assert c is not d and c[5] == d[5] == 1.0 and np.count_nonzero(c) == 1


# --- settings -> engine ----------------------------------------------------------------


def test_from_card_passes_the_chunk_size_and_segment_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    def from_model_dir(cls: type[ExLlamaV2Engine], model_dir: Path, **kw: Any) -> str:
        seen.update(kw)
        return "engine"

    monkeypatch.setattr(ExLlamaV2Engine, "from_model_dir", classmethod(from_model_dir))
    card = ModelCard(
        name="m", path=Path("/m"), context_length=4096, eos_token_ids=(2,), has_safetensors=True
    )
    settings = Settings(exllamav2_max_chunk_size=512, exllamav2_segment_tokens=256)
    assert ExLlamaV2Engine.from_card(card, settings) == "engine"
    assert (seen["max_chunk_size"], seen["segment_tokens"]) == (512, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        Settings(exllamav2_max_chunk_size=300)


# --- a continuation waiting for pages ------------------------------------------------------


def stall_of_a_continuation(monkeypatch: pytest.MonkeyPatch, max_skips: int) -> dict[str, int]:
    """Steps the live request L waits between its first segment and its continuation.

    8 pages. L (240 prompt tokens, segments of 16) holds 1 page; its continuation needs
    2 (256 + 16 tokens). Seven others hold a page each and end 30 steps apart from step
    31; a newcomer of one page arrives at every step. When L's first segment ends one
    page is free, so its continuation waits; newcomers may pass it ``max_skips`` times.
    """
    from workers.engines import exllamav2 as engine_module

    monkeypatch.setattr(engine_module, "CONTINUATION_MAX_SKIPS", max_skips)
    engine, _gen = make_engine(segment_tokens=16, cache_tokens=8 * 256, max_batch_size=64)
    none: frozenset[int] = frozenset()
    engine.submit(
        make_job("L", prompt=[3 + i % 90 for i in range(240)], max_new_tokens=48, eos=none)
    )
    for i in range(7):
        engine.submit(make_job(f"B{i}", prompt=[1, 2, 3], max_new_tokens=30 + 30 * i, eos=none))
    produced: list[int] = []
    paused, full = 0, False
    for step in range(1, 400):
        if not engine.has_work():
            break
        engine.submit(make_job(f"N{step}", prompt=[4, 5], max_new_tokens=40, eos=none))
        if any(s.job_id == "L" and s.delta.token_ids for s in engine.step()):
            produced.append(step)
        stats = engine.stats()
        paused = max(paused, int(stats["pending_continuations"]))
        full = full or stats["cache_usage"] == 1.0
        if len(produced) == 48:
            break
    gaps = [b - a for a, b in itertools.pairwise(produced)]
    return {"tokens": len(produced), "stall": max(gaps), "paused": paused, "full": full}


def test_a_continuation_is_not_passed_by_newcomers_while_pages_are_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = stall_of_a_continuation(monkeypatch, max_skips=4)  # exllamav2's default
    after = stall_of_a_continuation(monkeypatch, max_skips=0)
    print(f"continuation passed up to 4 times: {before}\nnever passed: {after}")
    assert before["tokens"] == after["tokens"] == 48
    # The gauges show it: paused streams (every job here runs in segments), the cache
    # full meanwhile.
    assert after["paused"] >= 1 and before["paused"] >= 1 and after["full"]
    # Never passed, it starts when the first other request ends (step 31) frees a page.
    assert after["stall"] <= 16
    assert before["stall"] >= 2 * after["stall"]


# --- logprobs: the model's own distribution ----------------------------------------------


def slope(ids: list[int]) -> np.ndarray:
    """Positive and negative logits that move with the context (the repetition penalty
    divides the first and multiplies the second)."""
    row = np.linspace(3.0, -3.0, VOCAB).astype(np.float32)
    row[(ids[-1] * 7) % VOCAB] += 1.5
    return row


def test_logprobs_are_the_raw_model_logits_whatever_the_bias_and_penalties() -> None:
    """As the llama.cpp engine reports them (before its sampler chain): exllamav2's
    returned rows carry the repetition penalty and the token bias, undone here."""
    engine, _gen = make_engine(segment_tokens=5, logits=slope)
    sampling = SamplingParams(
        temperature=0.0,
        logprobs=3,
        logit_bias={9: 4.0, 40: -2.0},
        presence_penalty=0.4,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
    )
    engine.submit(make_job(max_new_tokens=12, sampling=sampling, eos=frozenset()))
    steps = run_until_idle(engine, limit=100)
    got = [lp for s in steps for lp in s.delta.logprobs or ()]
    out = tokens_of(steps)
    assert len(got) == len(out) == 12
    context = list(PROMPT)
    for lp, tok in zip(got, out, strict=True):
        want = slope(context).astype(np.float64)
        want = want - np.log(np.exp(want - want.max()).sum()) - want.max()
        assert lp.token_id == tok and abs(lp.logprob - want[tok]) < 1e-4
        top = np.argsort(-want, kind="stable")[:3]
        assert [t for t, _ in lp.top] == top.tolist()
        assert all(abs(v - want[t]) < 1e-4 for t, v in lp.top)
        context.append(tok)
    # The penalties and the bias did change what was sampled.
    assert out != [int(np.argmax(slope([*PROMPT, *out[:i]]))) for i in range(12)]
