"""The prepared GPU run's phases on one loaded model: raw generator against the engine.

Each phase runs the same jobs twice, once on a bare ``ExLlamaV2DynamicGenerator`` (the
raw baseline: jobs built exactly as the engine builds them, results read directly) and
once through ``ExLlamaV2Engine``, each on a fresh generator, and reports tokens/s of both,
whether the ids are equal, and how the engine's tokens agree with the transformers
reference (benchmarks/gpu_reference.py). ``Backend`` is what differs between the device
run (exllamav2 on CUDA) and the dry run here (the stand-in generator of
tests/engines/exllamav2_standin.py with transformers on the CPU as its model): the
phases themselves are the same code in both.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.records import SamplingParams
from benchmarks.gpu_reference import Agreement, TransformersReference, common_prefix
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.exllamav2 import ExllamaApi, ExLlamaV2Engine
from workers.engines.exllamav2_jobs import ids_of, sampler_settings


@dataclass
class Backend:
    """The generator side of a run: ``new_generator(paged, max_batch_size, cache_tokens)``
    builds a fresh generator on the loaded model (warmed up)."""

    name: str
    api: ExllamaApi
    vocab_size: int
    new_generator: Callable[[bool, int, int], Any]


@dataclass
class Run:
    """One set of jobs run to the end: ids per job, seconds, and the generator's active
    jobs after each ``iterate()`` (the batch it ran)."""

    ids: dict[str, list[int]]
    seconds: float
    trace: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.ids.values()))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "jobs": len(self.ids),
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "max_active": max(self.trace, default=0),
            "steps": len(self.trace),
        }


GREEDY = SamplingParams(temperature=0.0)


def engine_job(
    job_id: str,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    sampling: SamplingParams = GREEDY,
    **fields: Any,
) -> EngineJob:
    """A job of one choice; no EOS unless ``eos_token_ids`` is given, so that every run
    generates exactly ``max_new_tokens`` and runs compare position by position."""
    return EngineJob(
        job_id=job_id,
        prompt_ids=list(prompt),
        choices=[ChoiceJob(0, max_new_tokens)],
        sampling=sampling,
        **fields,
    )


def run_raw(backend: Backend, generator: Any, jobs: Sequence[EngineJob]) -> Run:
    """``jobs`` on the bare generator, each built as ``ExLlamaV2Engine`` builds its first
    segment (greedy settings, stop ids, identifier), results read from ``iterate()``."""
    api = backend.api
    ids: dict[str, list[int]] = {j.job_id: [] for j in jobs}
    t0 = time.perf_counter()
    for job in jobs:
        generator.enqueue(
            api.job_cls(
                input_ids=api.input_ids(job.prompt_ids),
                max_new_tokens=job.choices[0].max_new_tokens,
                min_new_tokens=0,
                gen_settings=sampler_settings(api, job.sampling, None),
                seed=None,
                stop_conditions=sorted(job.all_stop_ids),
                return_logits=False,
                identifier=(job.job_id, 0),
            )
        )
    trace: list[int] = []
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r.get("stage") != "streaming":
                continue
            held = r.get("held") or {}
            for part in (r.get("token_ids"), held.get("token_ids")):
                if part is not None:
                    ids[r["identifier"][0]] += ids_of(part)
        trace.append(len(generator.active_jobs))
    return Run(ids, time.perf_counter() - t0, trace)


def run_engine(engine: ExLlamaV2Engine, jobs: Sequence[EngineJob]) -> Run:
    """``jobs`` through the engine: submitted at once, stepped until done."""
    ids: dict[str, list[int]] = {j.job_id: [] for j in jobs}
    t0 = time.perf_counter()
    for job in jobs:
        engine.submit(job)
    trace: list[int] = []
    while engine.has_work():
        for step in engine.step():
            ids[step.job_id] += step.delta.token_ids
        trace.append(len(engine.generator.active_jobs))
    return Run(ids, time.perf_counter() - t0, trace)


def steps_of(engine: ExLlamaV2Engine, job: EngineJob, cancel_after: int | None = None) -> Any:
    """One job alone through the engine: its ids, finish and logprobs (``cancel_after``:
    cancelled once it has that many tokens)."""
    engine.submit(job)
    ids: list[int] = []
    logprobs: list[float] = []
    finish = ""
    cancelled = False
    while engine.has_work():
        for step in engine.step():
            ids += step.delta.token_ids
            logprobs += [lp.logprob for lp in step.delta.logprobs or ()]
            if step.delta.finish is not None:
                finish = step.delta.finish.value
        if cancel_after is not None and not cancelled and len(ids) >= cancel_after:
            engine.cancel(job.job_id)
            cancelled = True
    return ids, finish, logprobs


def compare(
    raw: Run, engine: Run, ref: TransformersReference, prompts: dict[str, list[int]], margin: float
) -> dict[str, Any]:
    """Raw against engine (ids, tokens/s) and the engine's tokens against the reference."""
    agree = Agreement()
    for job_id, ids in engine.ids.items():
        agree.add(ref.check(prompts[job_id], ids, margin=margin))
    unequal = [j for j in raw.ids if raw.ids[j] != engine.ids.get(j)]
    return {
        "raw": raw.summary(),
        "engine": engine.summary(),
        "ratio": round(engine.tokens_per_s / raw.tokens_per_s, 3) if raw.tokens_per_s else None,
        "ids_equal": not unequal,
        "unequal": [
            {"job": j, "common_prefix": common_prefix(raw.ids[j], engine.ids.get(j, []))}
            for j in unequal[:8]
        ],
        "reference": agree.summary(margin),
    }


def paths(
    engine: ExLlamaV2Engine,
    ref: TransformersReference,
    prompt: list[int],
    tokens: int,
    *,
    margin: float,
    logprob_tolerance: float,
) -> dict[str, Any]:
    """The engine's paths a plain greedy run does not take, once each: a logit bias that
    bans the first greedy token, a stop id taken from the greedy output (the choice must
    end on it, with ``eos``), a cancel (``cancelled``, and the next job unaffected),
    logprobs against the reference's log-softmax, and every penalty against the
    reference's logits penalized as the sampler must."""
    out: dict[str, Any] = {}
    greedy, _, _ = steps_of(engine, engine_job("greedy", prompt, tokens))
    first = greedy[0]
    ids, finish, _ = steps_of(
        engine,
        engine_job(
            "bias",
            prompt,
            tokens,
            sampling=SamplingParams(temperature=0.0, logit_bias={first: -100}),
        ),
    )
    out["logit_bias"] = {"banned": first, "first": ids[:1], "ok": bool(ids) and ids[0] != first}
    at = next((k for k in range(3, len(greedy)) if greedy[k] not in greedy[:k]), None)
    if at is None:
        out["stop_token"] = {"ok": None, "why": "no fresh token in the greedy output"}
    else:
        stop = greedy[at]
        ids, finish, _ = steps_of(
            engine, engine_job("stop", prompt, tokens, stop_token_ids=frozenset({stop}))
        )
        out["stop_token"] = {
            "stop_id": stop,
            "tokens": len(ids),
            "finish": finish,
            "ok": ids == greedy[: at + 1] and finish == "eos",
        }
    ids, finish, _ = steps_of(engine, engine_job("cancel", prompt, tokens), cancel_after=4)
    after, _, _ = steps_of(engine, engine_job("after-cancel", prompt, tokens))
    out["cancel"] = {
        "tokens_before_end": len(ids),
        "finish": finish,
        "ok": finish == "cancelled" and len(ids) < tokens and after == greedy,
    }
    ids, _, logprobs = steps_of(
        engine,
        engine_job(
            "logprobs", prompt, tokens, sampling=SamplingParams(temperature=0.0, logprobs=5)
        ),
    )
    lp = ref.check(prompt, ids, margin=margin, logprobs=logprobs).summary(margin)
    err = lp["max_logprob_error"]
    out["logprobs"] = {
        **lp,
        "same_ids_as_greedy": ids == greedy,
        "tolerance": logprob_tolerance,
        "ok": lp["ok"]
        and len(logprobs) == len(ids)
        and err is not None
        and err <= logprob_tolerance,
    }
    penalties: dict[str, Any] = {"repetition": 1.3, "presence": 0.5, "frequency": 0.7}
    penalties["bias"] = {greedy[1]: -2.0}
    sampling = SamplingParams(
        temperature=0.0,
        logprobs=2,
        logit_bias=penalties["bias"],
        repetition_penalty=penalties["repetition"],
        presence_penalty=penalties["presence"],
        frequency_penalty=penalties["frequency"],
    )
    ids, _, logprobs = steps_of(engine, engine_job("penalties", prompt, tokens, sampling=sampling))
    pen = ref.check(prompt, ids, margin=margin, logprobs=logprobs, **penalties).summary(margin)
    err = pen["max_logprob_error"]
    out["penalties"] = {
        **pen,
        **penalties,
        "bias": {str(k): v for k, v in penalties["bias"].items()},
        "changed_output": ids != greedy,
        # logprobs: the raw distribution, as without penalties (both engines).
        "ok": pen["ok"] and err is not None and err <= logprob_tolerance,
    }
    return out


def unpaged_phase(
    backend: Backend,
    ref: TransformersReference,
    prompts: list[list[int]],
    *,
    tokens: int,
    long_tokens: int,
    segment_tokens: int,
    cache_tokens: int,
    margin: float,
    logprob_tolerance: float,
) -> dict[str, Any]:
    """Unpaged (one sequence at a time): raw vs engine on ``prompts``, a generation of
    ``long_tokens`` in segments of ``segment_tokens`` against one unsegmented, and the
    engine's other paths."""
    jobs = [engine_job(f"u{i}", p, tokens) for i, p in enumerate(prompts)]
    by_id = {j.job_id: j.prompt_ids for j in jobs}
    raw = run_raw(backend, backend.new_generator(False, 1, cache_tokens), jobs)

    def engine(segments: int) -> ExLlamaV2Engine:
        gen = backend.new_generator(False, 1, cache_tokens)
        return ExLlamaV2Engine(
            gen, vocab_size=backend.vocab_size, api=backend.api, segment_tokens=segments
        )

    main = engine(segment_tokens)
    run = run_engine(main, jobs)
    result = compare(raw, run, ref, by_id, margin)
    result["_engine_ids"] = [run.ids[j.job_id] for j in jobs]
    long = engine_job("long", prompts[0], long_tokens)
    whole = run_engine(engine(0), [long])
    segmented = run_engine(engine(segment_tokens), [long])
    result["segments"] = {
        "tokens": long_tokens,
        "segment_tokens": segment_tokens,
        "ids_equal": whole.ids == segmented.ids,
        "common_prefix": common_prefix(whole.ids["long"], segmented.ids["long"]),
        "reference": ref.check(prompts[0], segmented.ids["long"], margin=margin).summary(margin),
    }
    result["paths"] = paths(
        main, ref, prompts[0], tokens, margin=margin, logprob_tolerance=logprob_tolerance
    )
    result["ok"] = bool(
        result["ids_equal"]
        and result["reference"]["ok"]
        and result["segments"]["ids_equal"]
        and result["segments"]["reference"]["ok"]
        and all(v.get("ok") is not False for v in result["paths"].values())
    )
    return result


def paged_phase(
    backend: Backend,
    ref: TransformersReference,
    prompts: list[list[int]],
    *,
    tokens: int,
    cache_tokens: int,
    margin: float,
) -> dict[str, Any]:
    """Paged, every job at once: raw vs engine, the batch they reach, equal ids."""
    jobs = [engine_job(f"p{i}", p, tokens) for i, p in enumerate(prompts)]
    by_id = {j.job_id: j.prompt_ids for j in jobs}
    n = len(jobs)
    raw = run_raw(backend, backend.new_generator(True, n, cache_tokens), jobs)
    gen = backend.new_generator(True, n, cache_tokens)
    engine = ExLlamaV2Engine(gen, vocab_size=backend.vocab_size, api=backend.api)
    result = compare(raw, run_engine(engine, jobs), ref, by_id, margin)
    result["raw_ids"] = raw.ids
    result["ok"] = bool(
        result["ids_equal"] and result["reference"]["ok"] and result["engine"]["max_active"] == n
    )
    return result


def worker_phase(
    models_dir: Path,
    model: str,
    prompts: list[list[int]],
    *,
    tokens: int,
    raw: dict[str, Any],
    worker_module: str,
    cache_tokens: int,
    log_dir: Path,
) -> dict[str, Any]:
    """The same jobs as the paged phase through the real pipeline: a redis-server, a
    Celery worker running the exllamav2 engine (``worker_module``), a streamer; requests
    written as the web tier writes them. Tokens/s from the first submit to the last
    finish on the token streams, against the paged phase's raw generator (``raw``: its
    summary and ids); the streamer's texts against the raw ids decoded the same way."""
    import redis
    from tokenizers import Tokenizer

    from app.decoder import RequestDecoder
    from app.messages import EngineFinish, TokenDelta
    from app.records import RequestRecord, StopConditions
    from broker.celery_app import create_celery
    from broker.keys import Keys
    from broker.outputs import OutputStreams
    from broker.publish import decode_deltas
    from broker.requests import RequestStore
    from broker.server import RedisServer
    from tests.pipeline import collect
    from tests.stack import isolated_settings, registered_process, streamer_process

    tokenizer = Tokenizer.from_file(str(models_dir / model / "tokenizer.json"))
    started = time.perf_counter()
    with RedisServer() as server:
        settings = isolated_settings(
            server.url,
            models_dir,
            engine="exllamav2",
            model=model,
            worker_slots=len(prompts),
            max_n=1,
            exllamav2_cache_tokens=cache_tokens,
        )
        client = redis.Redis.from_url(server.url)
        store = RequestStore(client, Keys(settings.key_prefix))
        outputs = OutputStreams(client, Keys(settings.key_prefix))
        celery = create_celery(settings)

        def record(prompt: list[int], max_tokens: int) -> RequestRecord:
            now = time.time()
            return RequestRecord(
                request_id=uuid.uuid4().hex,
                model=settings.served_name,
                prompts=[prompt],
                sampling=GREEDY,
                stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
                created=now,
                deadline=now + 600,
            )

        def wait_finished(records: list[RequestRecord]) -> None:
            # Blocking XREAD on the token streams: a polling client would take CPU from
            # the worker it measures.
            cursors: dict[Any, Any] = {store.keys.tokens(r.request_id): "0-0" for r in records}
            deadline = time.monotonic() + 300
            while cursors and time.monotonic() < deadline:
                res: Any = client.xread(cursors, block=1000)
                for key_raw, entries in res or []:
                    key = key_raw.decode()
                    cursors[key] = entries[-1][0]
                    if any(
                        d.finish is not None for _e, f in entries for d in decode_deltas(f[b"d"])
                    ):
                        del cursors[key]
            if cursors:
                raise TimeoutError(f"{len(cursors)} requests did not finish in 300 s")

        with (
            registered_process(
                settings, log_dir, module=worker_module, kind="worker", name="worker"
            ),
            streamer_process(settings, log_dir),
        ):
            ready_s = time.perf_counter() - started
            warm = record(prompts[0], 4)
            store.submit(warm, celery)
            wait_finished([warm])
            records = [record(p, tokens) for p in prompts]
            t0 = time.perf_counter()
            for r in records:
                store.submit(r, celery)
            wait_finished(records)
            seconds = time.perf_counter() - t0
            ids = [store.progress(r.request_id, 1)[0].token_ids for r in records]
            texts = [
                collect(e for _n, e in outputs.follow(r.request_id, timeout_s=60)) for r in records
            ]
    raw_ids = list(raw["ids"].values())
    unequal_ids = [i for i, got in enumerate(ids) if got != raw_ids[i]]
    unequal_texts = []
    for i, (r, got) in enumerate(zip(records, texts, strict=True)):
        decoder = RequestDecoder.for_record(tokenizer, r)
        want = collect(iter(decoder.feed(TokenDelta(0, raw_ids[i], finish=EngineFinish.LENGTH))))
        if got.texts != want.texts or got.errors:
            unequal_texts.append(i)
    done = sum(map(len, ids))
    tokens_per_s = done / seconds if seconds else 0.0
    raw_tps = raw["summary"]["tokens_per_s"]
    return {
        "requests": len(records),
        "tokens": done,
        "run_seconds": round(seconds, 3),
        "tokens_per_s": round(tokens_per_s, 1),
        "raw_tokens_per_s": raw_tps,
        "ratio": round(tokens_per_s / raw_tps, 3) if raw_tps else None,
        "stack_ready_s": round(ready_s, 1),
        "ids_equal_raw": not unequal_ids,
        "texts_equal_raw": not unequal_texts,
        "unequal": {"ids": unequal_ids[:8], "texts": unequal_texts[:8]},
        "sample": texts[0].texts.get(0, "")[:200],
        "ok": not unequal_ids and not unequal_texts and done == len(records) * tokens,
    }
