"""Constrained decoding in the engines: the output parses and validates, always.

Against the real SmolLM2-135M GGUF on the CPU (llamacpp), sampled as well as greedy, so
that it is the grammar, not the model, that makes the output valid. The exllamav2
engine's filter is covered by tests/engines/test_exllamav2_mapping.py; the echo engine
ignores constraints (its output is the prompt) and is checked here to do exactly that.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.chat_template import PromptBuilder
from app.grammar import public_grammar_error
from app.messages import EngineFinish
from app.records import OutputConstraint, SamplingParams
from tests.engines.test_contract import (
    PROMPT,
    Choice,
    Run,
    advance,
    make_llamacpp,
)
from workers.engines import constraint
from workers.engines.base import ChoiceJob, EngineJob, JobRejected
from workers.engines.constraint import ConstraintError
from workers.engines.echo import EchoEngine
from workers.engines.llamacpp import LlamaCppEngine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}
WEATHER_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>\n", "\n</tool_call>"
MAX_NEW = 160


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """A minimal JSON-schema validator for the keywords these tests use (jsonschema is
    not a dependency): type, const, enum, properties, required, additionalProperties,
    items. Raises AssertionError naming the path of the first violation."""
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} != const {schema['const']!r}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    kind = schema.get("type")
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    }
    if kind is not None:
        assert checks[kind](value), f"{path}: {value!r} is not of type {kind}"
    if kind == "object":
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            assert name in value, f"{path}: missing required {name!r}"
        if schema.get("additionalProperties") is False:
            extra = set(value) - set(props)
            assert not extra, f"{path}: additional properties {extra}"
        for name, sub in props.items():
            if name in value:
                validate(value[name], sub, f"{path}.{name}")
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{i}]")


def test_the_validator_rejects_what_it_must() -> None:
    good = {"name": "a", "age": 3, "colour": "red", "tags": ["x"]}
    validate(good, PERSON)
    for bad in (
        {**good, "age": "3"},
        {**good, "colour": "pink"},
        {**good, "tags": [1]},
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "name"},
    ):
        with pytest.raises(AssertionError):
            validate(bad, PERSON)


@pytest.fixture(scope="module")
def engine(bundled_model_dir: Path) -> Iterator[LlamaCppEngine]:
    built = make_llamacpp(bundled_model_dir)
    assert isinstance(built, LlamaCppEngine)
    yield built
    built.close()


def chat(builder: PromptBuilder, text: str) -> list[int]:
    return builder.encode_chat([{"role": "user", "content": text}])


def constrained(
    job_id: str,
    prompt: list[int],
    constraint: OutputConstraint | None,
    *,
    n: int = 1,
    temperature: float = 1.0,
    seed: int = 11,
    eos: frozenset[int] = frozenset({2}),
) -> EngineJob:
    sampling = SamplingParams(temperature=temperature, seed=seed, constraint=constraint)
    choices = [ChoiceJob(i, MAX_NEW) for i in range(n)]
    return EngineJob(job_id, prompt, choices, sampling, eos_token_ids=eos)


def run_all(engine: LlamaCppEngine, *jobs: EngineJob) -> Run:
    for j in jobs:
        engine.submit(j)
    run = advance(engine, Run())
    assert not engine.has_work()
    assert engine.kv_pinned == 0 and engine.running_sequences == 0
    engine.check_kv()
    return run


def texts(run: Run, builder: PromptBuilder, job: EngineJob) -> list[str]:
    """Each choice's text; every choice must have ended by EOS (the grammar completed),
    not by length, or its JSON would be cut off."""
    out = []
    for c in job.choices:
        got = run[job.job_id, c.index]
        assert got.finishes == [EngineFinish.EOS], got.finishes
        out.append(builder.tokenizer.decode(got.tokens, skip_special_tokens=True))
    return out


def test_json_object_output_parses_greedy_and_sampled(
    engine: LlamaCppEngine, builder: PromptBuilder
) -> None:
    prompt = chat(builder, "Tell me about your favourite animal.")
    c = OutputConstraint(kind="json_object")
    jobs = [constrained("g", prompt, c, temperature=0.0), constrained("s", prompt, c, n=4)]
    run = run_all(engine, *jobs)
    for j in jobs:
        for text in texts(run, builder, j):
            assert isinstance(json.loads(text), dict), text


def test_json_schema_output_validates_for_every_sampled_choice(
    engine: LlamaCppEngine, builder: PromptBuilder
) -> None:
    prompt = chat(builder, "Write a short poem about autumn.")  # nothing about JSON
    c = OutputConstraint(kind="json_schema", json_schema=json.dumps(PERSON))
    jobs = [constrained(f"p{seed}", prompt, c, n=3, seed=seed) for seed in (1, 2)]
    run = run_all(engine, *jobs)
    outputs = [t for j in jobs for t in texts(run, builder, j)]
    for text in outputs:
        validate(json.loads(text), PERSON)
    assert len(set(outputs)) > 1  # sampled, not forced to one string


def test_tool_call_is_exactly_the_wrapper_around_a_valid_call(
    engine: LlamaCppEngine, builder: PromptBuilder
) -> None:
    prompt = chat(builder, "What's the weather like in Oslo for the next 3 days?")
    c = OutputConstraint(
        kind="tool_call",
        json_schema=json.dumps(WEATHER_CALL),
        prefix=HERMES_OPEN,
        suffix=HERMES_CLOSE,
    )
    jobs = [constrained("t", prompt, c, n=3), constrained("g", prompt, c, temperature=0.0)]
    run = run_all(engine, *jobs)
    for j in jobs:
        for text in texts(run, builder, j):
            assert text.startswith(HERMES_OPEN) and text.endswith(HERMES_CLOSE), repr(text)
            call = json.loads(text[len(HERMES_OPEN) : -len(HERMES_CLOSE)])
            validate(call, WEATHER_CALL)


def test_mixed_batch_leaves_the_unconstrained_choice_unchanged(
    engine: LlamaCppEngine, builder: PromptBuilder
) -> None:
    prompt = chat(builder, "List three colours.")
    plain = constrained("plain", list(PROMPT), None, temperature=0.0)
    alone = run_all(engine, plain)["plain", 0].tokens
    c = OutputConstraint(kind="json_schema", json_schema=json.dumps(PERSON))
    jobs = [constrained("c", prompt, c, n=2), plain, constrained("o", prompt, None, seed=3)]
    for j in jobs:
        engine.submit(j)
    run = Run()
    shared_steps = 0
    while engine.has_work():
        before = {k: len(ch.tokens) for k, ch in run.choices.items()}
        advance(engine, run, steps=1)
        moved = {k[0] for k, ch in run.choices.items() if len(ch.tokens) > before.get(k, 0)}
        shared_steps += "c" in moved and bool(moved & {"plain", "o"})
    # Constrained and unconstrained choices sampled from the same llama_decode.
    assert shared_steps >= 5
    assert run["plain", 0].tokens == alone
    for text in texts(run, builder, jobs[0]):
        validate(json.loads(text), PERSON)


def test_a_schema_that_cannot_be_enforced_rejects_the_job_naming_the_feature(
    engine: LlamaCppEngine,
) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    c = OutputConstraint(kind="json_schema", json_schema=json.dumps(schema))
    with pytest.raises(JobRejected, match="uniqueItems"):
        engine.submit(constrained("u", list(PROMPT), c))
    bad = OutputConstraint(kind="json_schema", json_schema="{not json")
    with pytest.raises(JobRejected, match="not valid JSON"):
        engine.submit(constrained("b", list(PROMPT), bad))
    assert not engine.has_work()


def test_a_resumed_choice_continues_its_grammar(
    engine: LlamaCppEngine, builder: PromptBuilder
) -> None:
    c = OutputConstraint(kind="json_schema", json_schema=json.dumps(PERSON))
    prompt = chat(builder, "Describe a person.")
    full = run_all(engine, constrained("f", prompt, c, temperature=0.0))["f", 0].tokens
    cut = len(full) // 2
    resumed = EngineJob(
        "r",
        prompt,
        [ChoiceJob(0, MAX_NEW - cut, prefix_ids=full[:cut])],
        SamplingParams(temperature=0.0, constraint=c),
        eos_token_ids=frozenset({2}),
    )
    rest = run_all(engine, resumed)["r", 0]
    # (Not necessarily token-equal to ``full``: prefilling the prefix in one chunk and
    # decoding it token by token differ in the last bits of the logits.)
    assert rest.finishes == [EngineFinish.EOS]
    validate(json.loads(builder.tokenizer.decode(full[:cut] + rest.tokens)), PERSON)
    # A prefix the grammar cannot have produced is refused up front.
    wrong = builder.tokenizer.encode("hello", add_special_tokens=False).ids
    bad = EngineJob(
        "w",
        prompt,
        [ChoiceJob(0, 10, prefix_ids=wrong)],
        SamplingParams(constraint=c),
    )
    with pytest.raises(JobRejected, match="grammar"):
        engine.submit(bad)


def test_a_grammar_failing_mid_run_ends_only_its_choice_with_a_400(
    engine: LlamaCppEngine, builder: PromptBuilder
) -> None:
    c = OutputConstraint(kind="json_schema", json_schema=json.dumps(PERSON))
    prompt = chat(builder, "Describe a person.")
    engine.submit(constrained("x", prompt, c, n=2, temperature=0.0))
    engine.submit(constrained("plain", list(PROMPT), None, temperature=0.0))
    run = advance(engine, Run(), steps=3)
    assert not run.choices.get(("x", 0), Choice()).finishes
    # Put choice 0's grammar into llguidance's error state (a token it refuses), as a
    # grammar that exhausts its parser limits would be: the next step must end that
    # choice alone, with a 400, and go on with the others.
    seq = next(s for s in engine._jobs["x"].seqs if s.index == 0)
    assert seq.grammar is not None
    with pytest.raises(ConstraintError):
        seq.grammar.consume(builder.tokenizer.token_to_id("<|im_start|>"))
    errors = []
    for _ in range(MAX_NEW * 2):
        if not engine.has_work():
            break
        for st in engine.step():
            if st.delta.finish is EngineFinish.ERROR:
                errors.append(st)
            else:
                ch = run.choices.setdefault((st.job_id, st.delta.choice), Choice())
                ch.tokens += st.delta.token_ids
                if st.delta.finish is not None:
                    ch.finishes.append(st.delta.finish)
    assert [(e.job_id, e.delta.choice, e.delta.error_code) for e in errors] == [("x", 0, 400)]
    assert "grammar" in (errors[0].delta.error or "")
    assert run["x", 1].finishes == [EngineFinish.EOS]
    validate(json.loads(builder.tokenizer.decode(run["x", 1].tokens)), PERSON)
    assert run["plain", 0].finishes
    assert engine.kv_pinned == 0 and engine.running_sequences == 0
    engine.check_kv()


def test_prepare_compiles_the_grammar_off_the_engine_thread(
    engine: LlamaCppEngine, builder: PromptBuilder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47, finding 1: ``prepare`` (the Celery task's thread) compiles the grammar,
    ``submit`` (the engine thread) only starts each choice's copy of it; what cannot be
    built is kept and rejects the job at submit, in plain words."""
    compiled: list[str] = []
    real = constraint.JobGrammar.__init__

    def counting(self: constraint.JobGrammar, vocab: Any, c: OutputConstraint) -> None:
        compiled.append(threading.current_thread().name)
        real(self, vocab, c)

    monkeypatch.setattr(constraint.JobGrammar, "__init__", counting)
    c = OutputConstraint(kind="json_schema", json_schema=json.dumps(PERSON))
    job = constrained("p", chat(builder, "Describe a person."), c, temperature=0.0)
    worker = threading.Thread(target=engine.prepare, args=(job,), name="task-thread")
    worker.start()
    worker.join()
    assert compiled == ["task-thread"]
    assert isinstance(job.prepared, constraint.JobGrammar)
    run = run_all(engine, job)
    assert compiled == ["task-thread"]  # not again at submit
    validate(json.loads(texts(run, builder, job)[0]), PERSON)

    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5001)}}
    bad = constrained(
        "w", list(PROMPT), OutputConstraint(kind="json_schema", json_schema=json.dumps(wide))
    )
    engine.prepare(bad)
    with pytest.raises(JobRejected, match="more than 5000 object properties"):
        engine.submit(bad)
    assert not engine.has_work()


def test_grammar_errors_reach_clients_in_plain_words() -> None:
    """Issue 47, finding 9: what llguidance says when a grammar fails mid-run (the
    texts a probe got back) is logged, and the client reads plain words."""
    leaks = ("row has", "max is", "lexer", "compute_time", "NoExtensionBias", "state")
    for internal in (
        "Current row has 8007 items; max is 2000",
        "lexer error: too many expressions constructed",
    ):
        public = public_grammar_error(internal)
        assert public.startswith("this JSON schema is too complex to enforce")
        assert not any(leak in public for leak in leaks)
    public = public_grammar_error("NoExtensionBias <state 17> ... compute_time_us=81234")
    assert "grammar" in public and not any(leak in public for leak in leaks)


def test_echo_ignores_constraints() -> None:
    echo = EchoEngine(context_length=2048)
    c = OutputConstraint(kind="json_object", prefix="<tool_call>\n")
    outs = []
    for i, sampling in enumerate((SamplingParams(), SamplingParams(constraint=c))):
        echo.submit(EngineJob(f"e{i}", list(PROMPT), [ChoiceJob(0, 50)], sampling))
        outs.append(advance(echo, Run())[f"e{i}", 0].tokens)
    assert outs[0] == outs[1]
    assert outs[1][: len(PROMPT)] == PROMPT
