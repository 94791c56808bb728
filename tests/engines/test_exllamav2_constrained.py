"""Constrained decoding in the exllamav2 engine, without a GPU.

The engine gives each constrained choice a ``GrammarFilter`` on its
``ExLlamaV2DynamicJob``; here the stand-in generator (test_exllamav2_mapping.py) holds
the job, and ``exl_generate`` drives its filters exactly as exllamav2 0.3.2's sampler and
job do (sampler.py:436-515 and 572-577, dynamic.py:1867-1935, 2110-2132): begin, get_next
(in the background pool as the generator schedules it), the single-token shortcut,
sampling among the allowed ids, feed, and the stop order (stop token, max_new_tokens,
end_filter). The logits are random: it is the grammar that makes the output valid. The
tokenizer and grammar are real (the bundled SmolLM2 vocabulary in llguidance).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np
import pytest
from tokenizers import Tokenizer

from app.messages import EngineFinish
from app.records import OutputConstraint, SamplingParams
from tests.engines.test_constrained import HERMES_CLOSE, HERMES_OPEN, PERSON, WEATHER_CALL, validate
from tests.engines.test_exllamav2_mapping import (
    StandInDynamicGenerator,
    StandInJob,
    held_back,
    make_job,
    run_until_idle,
    stand_in_api,
    stop_token,
    stream,
    toks,
)
from workers.engines.base import ChoiceJob, EngineJob, JobRejected
from workers.engines.constraint import CLOSING_TOKENS, GrammarVocab
from workers.engines.exllamav2 import ExLlamaV2Engine
from workers.engines.exllamav2_filter import GrammarFilter

pytestmark = pytest.mark.unit  # fakes only: no engine weights, no server

EOS = 2  # <|im_end|>
PROMPT = [1, 4093, 198, 19556, 665, 28, 638, 359, 346, 1834, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def vocab(smollm_tokenizer: Tokenizer) -> GrammarVocab:
    tok = llguidance.LLTokenizer(smollm_tokenizer.to_str(), eos_token=[EOS])
    return GrammarVocab(tok)


def make_engine(vocab: GrammarVocab) -> tuple[ExLlamaV2Engine, StandInDynamicGenerator]:
    generator = StandInDynamicGenerator()
    engine = ExLlamaV2Engine(
        generator, vocab_size=vocab.size, api=stand_in_api(), grammar_vocab=lambda: vocab
    )
    return engine, generator


def exl_generate(job: StandInJob, seed: int, pool: ThreadPoolExecutor) -> list[dict[str, Any]]:
    """The result dicts exllamav2 would stream for ``job``, its filters driving the
    sampling over random logits (see module doc)."""
    rng = np.random.default_rng(seed)
    filters: list[GrammarFilter] = job.filters
    stops = set(job.stop_conditions or [])
    for f in filters:
        f.background_drop()
        f.begin("")
    results: list[dict[str, Any]] = []
    for new in range(1, job.max_new_tokens + 1):
        logits = rng.normal(size=49152) * 3
        pass_tokens: set[int] | None = None
        end_tokens: set[int] = set()
        for f in filters:
            pt, et = f.get_next()
            pass_tokens = set(pt) if pass_tokens is None else pass_tokens & set(pt)
            end_tokens |= et
        assert pass_tokens, "Filter excluded all tokens"
        if len(pass_tokens) == 1:
            tok = next(iter(pass_tokens))
        else:
            allowed = sorted(pass_tokens)
            tok = allowed[int(np.argmax(logits[allowed]))]
        end_filter = tok in end_tokens
        for f in filters:
            f.feed(toks([tok])[:, :1])  # a (1, 1) tensor, as exllamav2 feeds it
            if new % 2:  # the generator schedules next() while the GPU runs
                f.background_next(pool)
        if tok in stops:
            results.append(stop_token([tok]))
            return results
        if new >= job.max_new_tokens:
            results.append({"eos": True, "eos_reason": "max_new_tokens", "token_ids": toks([tok])})
            return results
        if end_filter:
            results.append({"eos": True, "eos_reason": "end_filter", "token_ids": toks([tok])})
            return results
        results.append(stream([tok]))
    raise AssertionError("unreachable")


def run_constrained(
    engine: ExLlamaV2Engine, gen: StandInDynamicGenerator, job: EngineJob, seed: int = 0
) -> dict[int, tuple[list[int], list[EngineFinish], Any]]:
    engine.submit(job)
    with ThreadPoolExecutor(4) as pool:
        for i, exl_job in enumerate(gen.pending_jobs):
            gen.script(exl_job.identifier, held_back(), *exl_generate(exl_job, seed + i, pool))
    out: dict[int, tuple[list[int], list[EngineFinish], Any]] = {}
    for st in run_until_idle(engine, limit=1000):
        ids, fins, _ = out.setdefault(st.delta.choice, ([], [], None))
        ids += st.delta.token_ids
        if st.delta.finish is not None:
            fins.append(st.delta.finish)
            out[st.delta.choice] = (ids, fins, st.delta)
    return out


def text_of(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_unconstrained_jobs_get_no_filters(vocab: GrammarVocab) -> None:
    engine, gen = make_engine(vocab)
    engine.submit(make_job(prompt=PROMPT))
    assert gen.pending_jobs[0].filters == []


@pytest.mark.parametrize("max_new", [300, 60])
def test_json_schema_output_validates_with_random_logits(
    vocab: GrammarVocab, smollm_tokenizer: Tokenizer, max_new: int
) -> None:
    engine, gen = make_engine(vocab)
    c = OutputConstraint(kind="json_schema", json_schema=json.dumps(PERSON))
    job = make_job(
        prompt=PROMPT, n=3, max_new_tokens=max_new, sampling=SamplingParams(constraint=c)
    )
    out = run_constrained(engine, gen, job)
    assert sorted(out) == [0, 1, 2]
    for ids, fins, _ in out.values():
        # The grammar completes (closing mode near the budget's end), then only EOS is
        # allowed: the job stops on its stop token, before max_new_tokens.
        assert fins == [EngineFinish.EOS] and ids[-1] == EOS
        assert len(ids) < max_new
        validate(json.loads(text_of(smollm_tokenizer, ids)), PERSON)


def test_tool_call_wrapper_and_json_object(
    vocab: GrammarVocab, smollm_tokenizer: Tokenizer
) -> None:
    engine, gen = make_engine(vocab)
    call = OutputConstraint(
        kind="tool_call",
        json_schema=json.dumps(WEATHER_CALL),
        prefix=HERMES_OPEN,
        suffix=HERMES_CLOSE,
    )
    obj = OutputConstraint(kind="json_object")
    for i, c in enumerate((call, obj)):
        # ignore_eos (no stop ids): the filter itself ends the job ("end_filter").
        job = make_job(
            f"j{i}",
            prompt=PROMPT,
            n=2,
            max_new_tokens=200,
            eos=frozenset(),
            sampling=SamplingParams(constraint=c),
        )
        for ids, fins, _ in run_constrained(engine, gen, job, seed=10 * i).values():
            assert fins == [EngineFinish.EOS]
            text = text_of(smollm_tokenizer, ids)
            if c is call:
                assert text.startswith(HERMES_OPEN) and text.endswith(HERMES_CLOSE), text
                validate(json.loads(text[len(HERMES_OPEN) : -len(HERMES_CLOSE)]), WEATHER_CALL)
            else:
                assert isinstance(json.loads(text), dict)


def test_closing_mode_only_allows_closing_tokens_when_it_can(vocab: GrammarVocab) -> None:
    engine, gen = make_engine(vocab)
    c = OutputConstraint(kind="json_object")
    engine.submit(
        make_job(prompt=PROMPT, max_new_tokens=500, sampling=SamplingParams(constraint=c))
    )
    f: GrammarFilter = gen.pending_jobs[0].filters[0]
    for piece in ('{"', "abc"):  # inside a key string
        for tok in vocab.tokenizer.tokenize_str(piece):
            f.feed(tok)
    wide, _ = f.next()
    f.tokens_left = CLOSING_TOKENS
    narrow, _ = f.next()
    assert len(narrow) < 50 < len(wide)
    pieces = {vocab.tokenizer.decode_bytes([t]) for t in narrow}
    assert b'"' in pieces and all(set(p) <= set(b'"}]: ') for p in pieces)


def test_a_resumed_choice_starts_from_its_prefix(vocab: GrammarVocab) -> None:
    engine, gen = make_engine(vocab)
    c = OutputConstraint(kind="json_object")
    prefix = vocab.tokenizer.tokenize_str('{"a": ')
    engine.submit(
        EngineJob("r", PROMPT, [ChoiceJob(0, 50, prefix_ids=prefix)], SamplingParams(constraint=c))
    )
    allowed, _ = gen.pending_jobs[0].filters[0].next()
    # After '{"a": ' a value must follow: it may open a string, not close the object.
    assert vocab.tokenizer.tokenize_str('"')[0] in allowed
    assert vocab.tokenizer.tokenize_str("}")[0] not in allowed
    bad = vocab.tokenizer.tokenize_str("hello")
    with pytest.raises(JobRejected, match="grammar"):
        engine.submit(
            EngineJob("b", PROMPT, [ChoiceJob(0, 5, prefix_ids=bad)], SamplingParams(constraint=c))
        )


def test_unsupported_schema_is_rejected_naming_the_feature(vocab: GrammarVocab) -> None:
    engine, gen = make_engine(vocab)
    c = OutputConstraint(kind="json_schema", json_schema='{"type": "object", "not": {}}')
    with pytest.raises(JobRejected, match="not"):
        engine.submit(make_job(prompt=PROMPT, sampling=SamplingParams(constraint=c)))
    assert not gen.pending_jobs and not engine.has_work()


def test_engine_without_a_grammar_vocabulary_rejects_constraints() -> None:
    engine = ExLlamaV2Engine(StandInDynamicGenerator(), vocab_size=49152, api=stand_in_api())
    c = OutputConstraint(kind="json_object")
    with pytest.raises(JobRejected, match="tokenizer"):
        engine.submit(make_job(prompt=PROMPT, sampling=SamplingParams(constraint=c)))


def test_a_grammar_error_ends_that_choice_with_a_400_and_never_raises(
    vocab: GrammarVocab,
) -> None:
    engine, gen = make_engine(vocab)
    c = OutputConstraint(kind="json_object")
    engine.submit(make_job(prompt=PROMPT, n=2, sampling=SamplingParams(constraint=c)))
    broken: GrammarFilter = gen.pending_jobs[0].filters[0]
    broken.feed(vocab.tokenizer.tokenize_str("x")[0])  # refused: the grammar is in error
    assert broken.error is not None
    assert broken.next() == ([EOS], {EOS})  # only EOS, which ends the filter
    with ThreadPoolExecutor(2) as pool:
        for i, exl_job in enumerate(gen.pending_jobs):
            gen.script(exl_job.identifier, *exl_generate(exl_job, i, pool))
    finals = {st.delta.choice: st.delta for st in run_until_idle(engine) if st.delta.finish}
    assert finals[0].finish is EngineFinish.ERROR and finals[0].error_code == 400
    assert "grammar" in (finals[0].error or "")
    assert finals[1].finish is EngineFinish.EOS
