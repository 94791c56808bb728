"""ExLlamaV2 engine: tokenrelay's ``Engine`` interface on ExLlamaV2DynamicGenerator.

The production GPU engine. exllamav2 (last release 0.3.2) already does continuous
batching over a paged KV cache with prefix reuse; this module only maps tokenrelay's jobs
onto ``ExLlamaV2DynamicJob`` objects and the generator's result dicts back onto
``EngineStep`` values. The mapping layer never imports exllamav2 or torch itself: it gets
the generator and an ``ExllamaApi`` (the job/settings classes and two tensor builders)
from outside, so that it is tested on machines without a GPU with stand-ins below the
engine interface. ``ExLlamaV2Engine.from_model_dir`` is the only place that imports the
real library, lazily, because importing exllamav2 builds/loads its CUDA extension.

A constrained choice (``SamplingParams.constraint``) gets a ``GrammarFilter``
(workers/engines/exllamav2_filter.py) on its job: the same llguidance grammar as the
llama.cpp engine, through exllamav2's filter interface.

A choice runs as successive jobs of at most ``segment_tokens`` new tokens, so that the
cache holds as many sequences as their actual length allows, and its presence/frequency
penalties count generated tokens only: both are explained in
workers/engines/exllamav2_jobs.py, which holds the per-choice state.

Source references are to exllamav2 v0.3.2 (``exllamav2/generator/dynamic.py`` = dyn,
``exllamav2/generator/sampler.py`` = smp, ``exllamav2_ext/ext_sampling.cpp`` = ext).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import ModelError
from app.messages import EngineFinish, TokenDelta
from app.model_card import ModelCard
from app.settings import Settings
from workers.engines.base import Engine, EngineJob, EngineStep, JobRejected
from workers.engines.constraint import (
    ConstraintError,
    GrammarVocab,
    job_grammars,
    prepare_grammar,
)
from workers.engines.exllamav2_filter import GrammarFilter
from workers.engines.exllamav2_jobs import (
    OutputPenalties,
    _Choice,
    _Job,
    adjusted,
    clamped_bias,
    generator_stats,
    prompt_cache_hits,
    raw_logits,
    result_delta,
    sampler_settings,
)
from workers.engines.exllamav2_startup import (
    MODE_PAGED,
    MODE_UNPAGED,
    ModelLimits,
    StartupPlan,
    cache_class,
    free_cuda_memory,
    import_exllamav2,
    plan_startup,
    resolve_paged,
)

logger = logging.getLogger(__name__)

# New tokens one exllamav2 job reserves pages for (Settings.exllamav2_segment_tokens).
DEFAULT_SEGMENT_TOKENS = 512
# How many later jobs may start before a job that does not fit (dyn:1310-1320): a new
# request keeps exllamav2's default; a continuation none (``_start_segment``).
FIRST_MAX_SKIPS = 4
CONTINUATION_MAX_SKIPS = 0


@dataclass(frozen=True)
class ExllamaApi:
    """The exllamav2 and torch objects the mapping layer uses, and nothing else.

    Production resolves them from the real libraries (``ExllamaApi.load``); tests pass
    stand-ins. Keeping this surface small is what lets the mapping run without a GPU.
    """

    job_cls: Callable[..., Any]
    """``ExLlamaV2DynamicJob`` (dyn:1602)."""
    settings_cls: Callable[..., Any]
    """``ExLlamaV2Sampler.Settings`` (smp:52), a dataclass built from keyword arguments."""
    input_ids: Callable[[list[int]], Any]
    """Token ids -> CPU LongTensor of shape (1, n) (dyn:1691 asserts CPU, dyn:1720 the shape)."""
    token_bias: Callable[[int, dict[int, float]], Any]
    """(padded vocab size, {id: bias}) -> CPU FloatTensor added to the logits (smp:429)."""

    @classmethod
    def load(cls) -> ExllamaApi:
        """Import exllamav2 and torch (slow: this loads the CUDA extension)."""
        import torch
        from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

        def input_ids(ids: list[int]) -> Any:
            return torch.tensor([ids], dtype=torch.long)

        def token_bias(size: int, bias: dict[int, float]) -> Any:
            # ext fast_fadd_cpu needs float32 with numel == the logits' padded vocab.
            t = torch.zeros((size,), dtype=torch.float)
            for tok, value in bias.items():
                t[tok] = value
            return t

        return cls(ExLlamaV2DynamicJob, ExLlamaV2Sampler.Settings, input_ids, token_bias)


class ExLlamaV2Engine(Engine):
    """Maps tokenrelay jobs onto an ``ExLlamaV2DynamicGenerator`` (one job per choice).

    ``generator`` is a constructed ExLlamaV2DynamicGenerator (or a stand-in with the same
    surface: ``enqueue``, ``iterate``, ``cancel``, ``num_remaining_jobs``, and the
    attributes ``max_total_tokens``, ``max_seq_len``, ``max_batch_size``, ``paged``,
    ``padded_vocab_size``). Only one thread may call it (the generator is not
    thread-safe), which the Engine contract already guarantees.
    """

    name = "exllamav2"

    def __init__(
        self,
        generator: Any,
        *,
        vocab_size: int,
        api: ExllamaApi | None = None,
        on_close: Callable[[], None] | None = None,
        grammar_vocab: Callable[[], GrammarVocab] | None = None,
        segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
    ) -> None:
        self._generator = generator
        # Read once, here: the start-up log, the heartbeat (another thread) and a closed
        # engine all answer them without touching the generator.
        self._paged = bool(generator.paged)
        # Unpaged mode has a single cache page, so one job at a time (dyn:384-391).
        self._capacity = int(generator.max_batch_size) if self._paged else 1
        self._vocab_size = vocab_size
        # Most new tokens one exllamav2 job reserves pages for; 0 = the whole max_tokens.
        self._segment_tokens = segment_tokens
        self._api = api
        self._on_close = on_close
        # Builds llguidance's view of the vocabulary on the first constrained job.
        self._grammar_vocab_factory = grammar_vocab
        self._grammar_vocab: GrammarVocab | None = None
        self._vocab_lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}

    # --- construction -------------------------------------------------------------

    @classmethod
    def from_card(cls, card: ModelCard, settings: Settings) -> ExLlamaV2Engine:
        """The engine for a model card's directory, sized from settings."""
        if not card.has_safetensors:
            raise ModelError(f"model {card.name!r} has no safetensors weights for exllamav2")
        return cls.from_model_dir(
            card.path,
            cache_tokens=settings.exllamav2_cache_tokens,
            max_batch_size=settings.worker_slots * settings.max_n,
            eos_token_ids=list(card.eos_token_ids),
            max_chunk_size=settings.exllamav2_max_chunk_size,
            segment_tokens=settings.exllamav2_segment_tokens,
            allow_unpaged=settings.exllamav2_allow_unpaged,
        )

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        *,
        cache_tokens: int,
        max_batch_size: int,
        cache_bits: int = 16,
        max_chunk_size: int | None = None,
        paged: bool | None = None,
        warmup: bool = True,
        eos_token_ids: list[int] | None = None,
        segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
        allow_unpaged: bool = False,
    ) -> ExLlamaV2Engine:
        """Load an EXL2 or FP16 HF-style model directory onto the visible GPUs.

        ``cache_tokens`` is the KV cache shared by all running sequences (rounded up to a
        multiple of 256, dyn:389). ``paged=None`` uses paged attention when flash-attn
        2.5.7+ is importable (attn.py:47-59); without it the generator would run unpaged,
        one sequence at a time (dyn:314-317), and this refuses to start unless
        ``allow_unpaged``. Every limit exllamav2 asserts on is checked from config.json
        before the weights load (``exllamav2_startup.plan_startup``).
        ``cache_bits`` 16 is an FP16 cache; 4/6/8 select the quantized Q4/Q6/Q8 caches
        (the plain 8-bit cache is refused by the dynamic generator, dyn:359).
        """
        exllamav2, exl_attn, ExLlamaV2DynamicGenerator = import_exllamav2()

        cache_cls = cache_class(cache_bits)
        config = exllamav2.ExLlamaV2Config(str(model_dir))  # reads no weights
        config.arch_compat_overrides()
        plan = plan_startup(
            ModelLimits(config.max_seq_len, config.max_input_len, config.max_batch_size),
            cache_tokens=cache_tokens,
            max_batch_size=max_batch_size,
            max_chunk_size=max_chunk_size,
            paged=resolve_paged(
                paged,
                has_paged_attention=bool(exl_attn.has_flash_attn_with_paged),
                no_flash_attn=bool(config.no_flash_attn),
                allow_unpaged=allow_unpaged,
            ),
        )
        for warning in plan.warnings:
            logger.warning("exllamav2: %s", warning)

        model = exllamav2.ExLlamaV2(config)
        cache = cache_cls(model, max_seq_len=plan.cache_tokens, lazy=True)
        model.load_autosplit(cache, progress=False)
        tokenizer = exllamav2.ExLlamaV2Tokenizer(config)
        generator = ExLlamaV2DynamicGenerator(
            model=model,
            cache=cache,
            tokenizer=tokenizer,
            max_batch_size=plan.max_batch_size,
            max_chunk_size=plan.max_chunk_size,
            paged=plan.paged,
        )
        if warmup:
            generator.warmup()  # kernel autotune before the first real job (dyn:514)
        _log_loaded(model_dir, plan, config.max_input_len)
        eos = eos_token_ids or [tokenizer.eos_token_id]
        release = _releaser(model, cache)
        del model, cache
        return cls(
            generator,
            vocab_size=config.vocab_size,
            api=ExllamaApi.load(),
            on_close=release,
            grammar_vocab=lambda: _grammar_vocab(Path(model_dir), config.vocab_size, eos),
            segment_tokens=segment_tokens,
        )

    # --- Engine interface ------------------------------------------------------------

    @property
    def generator(self) -> Any:
        """The wrapped generator (read-only use: benchmarks look at its active jobs);
        None once the engine is closed."""
        return self._generator

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def mode(self) -> str:
        """``paged`` (continuous batching) or ``unpaged`` (one sequence at a time)."""
        return MODE_PAGED if self._paged else MODE_UNPAGED

    def stats(self) -> dict[str, float]:
        gen = self._generator
        return {} if gen is None else generator_stats(gen, self._jobs.values(), self._paged)

    def has_work(self) -> bool:
        return any(not c.done for job in self._jobs.values() for c in job.choices.values())

    def prepare(self, job: EngineJob) -> None:
        prepare_grammar(job, self._vocab)

    def submit(self, job: EngineJob) -> None:
        if job.job_id in self._jobs:
            raise JobRejected(f"job {job.job_id} is already running")
        self._validate(job)
        filters = self._filters(job)
        api = self._load_api()
        sampling = job.sampling
        bias = self._token_bias(api, sampling.logit_bias)
        state = _Job(job.job_id, job, sorted(job.all_stop_ids))
        self._jobs[job.job_id] = state
        for choice in job.choices:
            c = _Choice(
                choice.index, job.prompt_ids, list(choice.prefix_ids), choice.max_new_tokens
            )
            state.choices[choice.index] = c
            if choice.max_new_tokens <= 0:
                # A resumed choice with nothing left; exllamav2 would still sample one.
                c.pending = TokenDelta(choice.index, [], finish=EngineFinish.LENGTH)
                continue
            c.grammar = filters.get(choice.index)
            choice_bias = bias
            if OutputPenalties.wanted(sampling):
                # Its own tensor, updated as it generates; a resumed prefix counts too.
                clamped = clamped_bias(sampling.logit_bias)
                choice_bias = api.token_bias(int(self._generator.padded_vocab_size), clamped)
                c.penalties = OutputPenalties(
                    choice_bias,
                    clamped,
                    presence=sampling.presence_penalty,
                    frequency=sampling.frequency_penalty,
                )
                c.penalties.count(choice.prefix_ids)
            c.settings = sampler_settings(api, sampling, choice_bias)
            self._start_segment(api, state, c)

    def cancel(self, job_id: str) -> None:
        state = self._jobs.get(job_id)
        if state is None:
            return
        for c in state.choices.values():
            if c.done:
                continue
            if c.exl_job is not None:
                try:
                    # Removes a pending job or frees an active one's pages (dyn:856).
                    self._generator.cancel(c.exl_job)
                except Exception:
                    logger.exception("exllamav2 cancel failed for %s choice %d", job_id, c.index)
                c.exl_job = None
            c.pending = TokenDelta(c.index, [], finish=EngineFinish.CANCELLED)

    def step(self) -> list[EngineStep]:
        out: list[EngineStep] = []
        for state in self._jobs.values():
            for c in state.choices.values():
                if c.pending is not None:
                    out.append(EngineStep(state.job_id, c.pending))
                    c.pending = None
                    c.done = True
        if self._generator.num_remaining_jobs():
            # An exception here cannot be pinned on one job (one forward pass serves the
            # whole batch), so it propagates: the engine itself is broken.
            results = self._generator.iterate()
            # Penalties first: a segment that just ended is replaced while mapping.
            for state in self._jobs.values():
                for c in state.choices.values():
                    if c.penalties is not None and c.exl_job is not None and not c.done:
                        c.penalties.observe(c.exl_job)
            for result in results:
                step = self._map_result(result)
                if step is not None:
                    out.append(step)
        for job_id in [j for j, s in self._jobs.items() if all(c.done for c in s.choices.values())]:
            del self._jobs[job_id]
        return out

    def close(self) -> None:
        """Cancel what runs, then let go of the GPU: the generator (which holds the
        model, the cache and its buffers) is dropped and ``on_close`` unloads the weights
        and returns CUDA's cached memory. Only the engine's own thread, or a caller that
        knows that thread has ended, may call it (``WorkerRuntime.stop``)."""
        if self._generator is not None:
            for job_id in list(self._jobs):
                self.cancel(job_id)
        self._jobs.clear()
        self._generator = None
        self._grammar_vocab = None
        self._grammar_vocab_factory = None
        release, self._on_close = self._on_close, None
        if release is not None:
            release()

    # --- mapping ---------------------------------------------------------------------

    def _load_api(self) -> ExllamaApi:
        if self._api is None:
            self._api = ExllamaApi.load()
        return self._api

    def _validate(self, job: EngineJob) -> None:
        """Reject up front what exllamav2 would assert on, or what would crash the GPU.

        A job needs ceil((P + M) / page) pages and the cache has cache_tokens / page of
        them (dyn:2258-2290; unpaged: one page of cache_tokens). Segments keep M small and
        a sequence that reaches the cache's size finishes with ``length``, so only a
        prompt with no room left for one new token cannot run. A token id past the
        vocabulary would index out of range in the embedding kernel, a CUDA error that
        takes every other job down with it.
        """
        if not job.prompt_ids:
            raise JobRejected("the prompt is empty")  # dyn:1719 asserts a non-empty input
        if not job.choices:
            raise JobRejected("the job has no choices")
        vocab = self._vocab_size
        ids = [*job.prompt_ids, *(t for c in job.choices for t in c.prefix_ids)]
        if min(ids) < 0 or max(ids) >= vocab:
            raise JobRejected(f"prompt token ids must be in [0, {vocab})")
        for name, values in (
            ("stop token ids", job.all_stop_ids),
            ("logit_bias token ids", job.sampling.logit_bias.keys()),
        ):
            if any(t < 0 or t >= vocab for t in values):
                raise JobRejected(f"{name} must be in [0, {vocab})")
        cache = int(self._generator.max_total_tokens)
        context = int(self._generator.max_seq_len)
        for choice in job.choices:
            p = len(job.prompt_ids) + len(choice.prefix_ids)
            m = max(choice.max_new_tokens, 0)
            if m > 0 and p + 1 > cache:
                raise JobRejected(
                    f"prompt ({p} tokens) leaves no room in the cache ({cache} tokens)"
                )
            if p + m > context:
                # Rotary tables are sized to the model's max_seq_len.
                raise JobRejected(
                    f"prompt ({p} tokens) + max_tokens ({m}) exceeds the model's "
                    f"context ({context} tokens)"
                )

    def _filters(self, job: EngineJob) -> dict[int, GrammarFilter]:
        """Each choice's grammar filter when the job is constrained (``job_grammars``)."""
        states = job_grammars(job, self._vocab)
        limits = {c.index: c.max_new_tokens for c in job.choices}
        return {i: GrammarFilter(state, limits[i]) for i, state in states.items()}

    def _vocab(self) -> GrammarVocab:
        with self._vocab_lock:  # ``prepare`` runs on the threads handing jobs over
            if self._grammar_vocab is None:
                if self._grammar_vocab_factory is None:
                    raise ConstraintError("this engine has no tokenizer for output grammars")
                self._grammar_vocab = self._grammar_vocab_factory()
            return self._grammar_vocab

    def _token_bias(self, api: ExllamaApi, logit_bias: dict[int, float]) -> Any:
        if not logit_bias:
            return None
        # The logits row is padded to a multiple of 32 (dyn:333), the bias must match it.
        return api.token_bias(int(self._generator.padded_vocab_size), clamped_bias(logit_bias))

    def _start_segment(
        self, api: ExllamaApi, state: _Job, c: _Choice, previous: Any = None
    ) -> None:
        """Enqueue the choice's next exllamav2 job (its first, or the continuation of
        ``previous``, which just ended on max_new_tokens); a refusal errors this choice
        alone. With no room left in the cache the choice finishes with ``length``."""
        job = state.job
        n = c.segment_length(self._segment_tokens, int(self._generator.max_total_tokens))
        if n <= 0:
            c.exl_job = None
            c.pending = TokenDelta(
                c.index, [], finish=EngineFinish.LENGTH, cached_tokens=c.cached_tokens
            )
            return
        seed = job.sampling.seed
        # Only constrained jobs pass filters, so an unconstrained job is built exactly
        # as before (exllamav2 refuses filters together with banned strings, dyn:1769).
        # The same filter object serves every segment: it holds the grammar's state.
        extra: dict[str, Any] = {"filters": [c.grammar]} if c.grammar is not None else {}
        context = c.context()
        try:
            exl_job = api.job_cls(
                # A resumed choice or a later segment continues from its own tokens; the
                # shared prompt's full pages are found by hash and reused (dyn:2551).
                input_ids=api.input_ids(context),
                max_new_tokens=n,
                # Stop tokens are blocked until this many new tokens exist (dyn:1881-1885);
                # a resumed prefix and earlier segments count towards min_tokens.
                min_new_tokens=max(0, job.min_tokens - len(c.generated)),
                gen_settings=c.settings,
                # Distinct seeds per choice, or n seeded choices would be n copies.
                seed=None if seed is None else seed + c.index,
                # Ints only: strings would make exllamav2 match stop strings on its own
                # text, which is the streamer's job. An empty list means no stop at all.
                stop_conditions=state.stop_conditions,
                return_logits=job.sampling.logprobs is not None,
                identifier=(job.job_id, c.index),
                # A continuation's stream is live: no newcomer may start while it waits
                # for pages (exllamav2 lets later jobs pass a job that does not fit up
                # to max_skips times, dyn:1310-1320, and each one takes pages it needs).
                max_skips=CONTINUATION_MAX_SKIPS if previous is not None else FIRST_MAX_SKIPS,
                **extra,
            )
            if previous is not None:
                # One random stream per choice: job.rng is drawn once per token (dyn:1740,
                # 1892), so a seeded choice samples as if it were one long job.
                exl_job.rng = previous.rng
            self._generator.enqueue(exl_job)
            if previous is not None:
                self._to_front(exl_job)
        except Exception:
            logger.exception("exllamav2 refused job %s choice %d", job.job_id, c.index)
            c.exl_job = None
            c.pending = TokenDelta(
                c.index, [], finish=EngineFinish.ERROR, error="the engine failed"
            )
            return
        c.exl_job = exl_job
        c.segments += 1
        if c.penalties is not None:
            c.penalties.follow(len(context))

    def _to_front(self, exl_job: Any) -> None:
        """A continuation starts before jobs that have not started yet: its stream is
        live, and the pages its previous segment just released are still cached. Jobs
        start in ``pending_jobs`` order (dyn:1310-1330), enqueue appends (dyn:851)."""
        pending = self._generator.pending_jobs
        if pending and pending[-1] is exl_job:
            pending.insert(0, pending.pop())

    def _map_result(self, result: dict[str, Any]) -> EngineStep | None:
        """One ``iterate()`` result dict (dyn:916-985) -> one EngineStep, or None."""
        if result.get("stage") != "streaming":
            return None  # "started" / "prefill" carry no tokens
        key = result.get("identifier")
        if not isinstance(key, tuple):
            return None
        job_id, index = key
        state = self._jobs.get(job_id)
        c = state.choices.get(index) if state is not None else None
        if state is None or c is None or c.done or c.pending is not None:
            return None
        try:
            sampling = state.job.sampling
            unadjust = None
            if state.logprobs is not None and adjusted(sampling):
                context, generated = c.context(), list(c.generated)

                def unadjust(rows: Any, tokens: list[int]) -> Any:
                    return raw_logits(rows, tokens, context, generated, sampling)

            delta = result_delta(c.index, result, state.logprobs, unadjust)
        except Exception:
            logger.exception("cannot map exllamav2 output of %s choice %d", state.job_id, c.index)
            if not result.get("eos") and c.exl_job is not None:
                self._generator.cancel(c.exl_job)
            delta = TokenDelta(c.index, [], finish=EngineFinish.ERROR, error="the engine failed")
        if not c.told_cached and delta.cached_tokens is None and delta.token_ids:
            # With the first tokens: a stop string may end the choice in the streamer
            # before its finish (which carries exllamav2's own count) comes.
            delta.cached_tokens = prompt_cache_hits(c.exl_job, self._generator.page_size)
        c.told_cached = c.told_cached or delta.cached_tokens is not None
        c.generated += delta.token_ids
        c.left -= len(delta.token_ids)
        grammar_error = c.grammar.error if c.grammar is not None else None
        failed = grammar_error is not None
        if delta.finish is EngineFinish.LENGTH and c.left > 0 and not failed:
            # A segment's end, not the choice's: continue it (module docstring of
            # exllamav2_jobs). Its cached_tokens describe the prompt, so they are kept.
            if c.segments == 1:
                c.cached_tokens = delta.cached_tokens
            self._start_segment(self._load_api(), state, c, previous=c.exl_job)
            ended, c.pending = c.pending, None  # no room left, or refused: ends here
            delta.finish = ended.finish if ended is not None else None
            delta.error = ended.error if ended is not None else None
        if c.segments > 1:
            delta.cached_tokens = c.cached_tokens if delta.finish is not None else None
        if delta.finish is not None:
            if failed:
                # The filter ended the job on a grammar error (it never raises into
                # the generator): the request's constraint failed, a 400.
                delta.finish = EngineFinish.ERROR
                delta.error = grammar_error
                delta.error_code = 400
            c.done = True
            c.exl_job = None
        elif not delta.token_ids:
            return None  # output held back by exllamav2 (incomplete UTF-8, dyn:2137)
        return EngineStep(state.job_id, delta)


def _grammar_vocab(model_dir: Path, n_vocab: int, eos: list[int]) -> GrammarVocab:
    """The model's vocabulary for llguidance, built on the first constrained job."""
    import llguidance

    text = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    return GrammarVocab(llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos))


def _releaser(model: Any, cache: Any) -> Callable[[], None]:
    """What frees the GPU memory of a loaded model: only this closure keeps the model and
    its cache once the engine drops the generator, and ``close`` runs it."""
    gpu: dict[str, Any] = {"model": model, "cache": cache}

    def release() -> None:
        gpu["model"].unload()
        gpu.clear()
        free_cuda_memory()

    return release


def _log_loaded(model_dir: Path, plan: StartupPlan, max_input_len: int) -> None:
    logger.info(
        "exllamav2 loaded %s: %s attention, capacity %d sequences, cache %d tokens, "
        "prefill chunk %s tokens",
        model_dir,
        plan.mode,
        plan.capacity,
        plan.cache_tokens,
        plan.max_chunk_size or max_input_len,
    )
