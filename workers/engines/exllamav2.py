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

Source references are to exllamav2 v0.3.2 (``exllamav2/generator/dynamic.py`` = dyn,
``exllamav2/generator/sampler.py`` = smp, ``exllamav2_ext/ext_sampling.cpp`` = ext).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.errors import ModelError
from app.messages import EngineFinish, SamplingParams, TokenDelta, TokenLogprob
from app.model_card import ModelCard
from app.settings import Settings
from workers.engines.base import ChoiceJob, Engine, EngineJob, EngineStep, JobRejected
from workers.engines.constraint import ConstraintError, GrammarVocab, JobGrammar
from workers.engines.exllamav2_filter import GrammarFilter

logger = logging.getLogger(__name__)

# dyn:389 asserts cache.max_seq_len % 256 == 0 (PAGED_PAGE_SIZE), paged or not.
CACHE_GRANULE = 256

# OpenAI caps logit_bias at +-100; exllamav2 adds the bias to the logits as is (smp:429).
_MAX_BIAS = 100.0

# What a logprob of -inf (a token the penalties or the vocab padding ruled out) is
# published as: JSON has no -Infinity, and vLLM's OpenAI server uses the same floor.
_LOGPROB_FLOOR = -9999.0

# ExLlamaV2Sampler.Settings fields (smp:52-100) that tokenrelay never exposes, pinned to
# their neutral values so that no exllamav2 default can change the distribution. The
# non-neutral defaults (temperature 0.8, top_k 50, top_p 0.8, token_repetition_penalty
# 1.025) are always overwritten from SamplingParams by ``sampler_settings``.
NEUTRAL_SETTINGS: dict[str, Any] = {
    "token_repetition_range": -1,  # whole sequence (ext apply_rep_penalty: -1 = seq_len)
    "token_repetition_decay": 0,
    "smoothing_factor": 0.0,
    "min_temp": 0.0,
    "max_temp": 0.0,  # dynamic temperature only when max_temp > min_temp (ext:217)
    "temp_exponent": 1.0,
    "top_a": 0.0,
    "tfs": 0.0,
    "typical": 0.0,
    "skew": 0.0,
    "temperature_last": False,
    "mirostat": False,
    "cfg_scale": None,  # CFG would need two sequences per job (dyn:1863)
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
}


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


def sampler_settings(api: ExllamaApi, sampling: SamplingParams, token_bias: Any) -> Any:
    """One ``ExLlamaV2Sampler.Settings`` with every field that matters set explicitly.

    Greedy (temperature 0) is spelled the way ``Settings.greedy()`` spells it (smp:102):
    top_k 1, top_p 0, temperature 1. The extension would also turn temperature < 0.01
    into top_k 1 on its own (ext:147), but being explicit keeps the intent visible.
    Penalties and logit_bias still apply when greedy, as they do for OpenAI.
    top_k 0 and top_p 1.0 / min_p 0 are exllamav2's own "disabled" values (ext:175-197).
    """
    greedy = sampling.temperature == 0.0
    return api.settings_cls(
        **NEUTRAL_SETTINGS,
        temperature=1.0 if greedy else sampling.temperature,
        top_k=1 if greedy else sampling.top_k,
        top_p=0.0 if greedy else sampling.top_p,
        min_p=sampling.min_p,
        # exllamav2 applies all three over prompt + output (range -1), the way HF's
        # repetition_penalty does; OpenAI's presence/frequency penalties count output
        # tokens only. 1.0 / 0.0 / 0.0 skip the penalty pass entirely (smp:408).
        token_repetition_penalty=sampling.repetition_penalty,
        token_presence_penalty=sampling.presence_penalty,
        token_frequency_penalty=sampling.frequency_penalty,
        token_bias=token_bias,
    )


def logprobs_from_logits(logits: np.ndarray, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Log-softmax of each row of ``logits`` (n, vocab) for the sampled ids, plus top k.

    exllamav2's ``return_probs``/``return_top_tokens`` report probabilities *after*
    top-k/top-p truncation and temperature (ext:239-284): under greedy decoding every
    sampled token would get logprob 0 and every alternative -inf. The logits it returns
    with ``return_logits`` are the model's, with penalties, logit_bias and min_tokens
    blocking already applied in place (smp:408-429) but before temperature and
    truncation, which is the distribution OpenAI's logprobs describe.
    """
    rows = np.asarray(logits, dtype=np.float32)
    peak = rows.max(axis=1, keepdims=True)
    with np.errstate(under="ignore"):
        lse = peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True))
    lp = np.maximum(rows - lse, _LOGPROB_FLOOR)
    out: list[TokenLogprob] = []
    for i, tok in enumerate(token_ids):
        top: list[tuple[int, float]] = []
        if k > 0:
            row = lp[i]
            kk = min(k, row.shape[0])
            idx = np.argpartition(-row, kk - 1)[:kk]
            idx = idx[np.argsort(-row[idx], kind="stable")]
            top = [(int(j), float(row[j])) for j in idx]
        out.append(TokenLogprob(int(tok), float(lp[i, tok]), top))
    return out


def _ids(tensor: Any) -> list[int]:
    """Token ids of a (1, n) tensor (torch in production, anything with tolist in tests)."""
    return [int(t) for t in tensor.tolist()[0]]


@dataclass(slots=True)
class _Choice:
    index: int
    exl_job: Any = None
    done: bool = False
    grammar: GrammarFilter | None = None  # a constrained choice's filter
    # A finish decided outside the generator (cancel, error, nothing left to generate),
    # reported at the next step() so that every finish goes out the same way.
    pending: TokenDelta | None = None


@dataclass(slots=True)
class _Job:
    job_id: str
    logprobs: int | None
    choices: dict[int, _Choice] = field(default_factory=dict)


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
    ) -> None:
        self._generator = generator
        self._vocab_size = vocab_size
        self._api = api
        self._on_close = on_close
        # Builds llguidance's view of the vocabulary on the first constrained job.
        self._grammar_vocab_factory = grammar_vocab
        self._grammar_vocab: GrammarVocab | None = None
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
    ) -> ExLlamaV2Engine:
        """Load an EXL2 or FP16 HF-style model directory onto the visible GPUs.

        ``cache_tokens`` is the KV cache shared by all running sequences (rounded up to a
        multiple of 256, dyn:389). ``paged=None`` uses paged attention when flash-attn
        2.5.7+ is importable (attn.py:47-59); without it the generator runs unpaged, which
        supports one sequence at a time (dyn:316-318), so ``capacity`` becomes 1.
        ``cache_bits`` 16 is an FP16 cache; 4/6/8 select the quantized Q4/Q6/Q8 caches
        (the plain 8-bit cache is refused by the dynamic generator, dyn:359).
        """
        import exllamav2
        from exllamav2 import attn as exl_attn
        from exllamav2.generator import ExLlamaV2DynamicGenerator

        config = exllamav2.ExLlamaV2Config(str(model_dir))
        config.arch_compat_overrides()
        if paged is None:
            paged = exl_attn.has_flash_attn_with_paged and not config.no_flash_attn
            if not paged:
                logger.warning("flash-attn >= 2.5.7 unavailable: unpaged mode, one sequence")
        batch = max_batch_size if paged else 1
        tokens = -(-cache_tokens // CACHE_GRANULE) * CACHE_GRANULE

        caches = {
            16: exllamav2.ExLlamaV2Cache,
            8: exllamav2.ExLlamaV2Cache_Q8,
            6: exllamav2.ExLlamaV2Cache_Q6,
            4: exllamav2.ExLlamaV2Cache_Q4,
        }
        if cache_bits not in caches:
            raise ValueError(f"cache_bits must be one of {sorted(caches)}, not {cache_bits}")
        cache_cls = caches[cache_bits]
        model = exllamav2.ExLlamaV2(config)
        cache = cache_cls(model, max_seq_len=tokens, lazy=True)
        model.load_autosplit(cache, progress=False)
        tokenizer = exllamav2.ExLlamaV2Tokenizer(config)

        # dyn:364-370 asserts max_batch_size * max_q_size (8) <= config.max_batch_size *
        # config.max_input_len; load_autosplit lowered max_input_len to max_seq_len.
        room = config.max_batch_size * config.max_input_len
        if batch * 8 > room:
            model.unload()
            raise ValueError(
                f"max_batch_size {batch} too large for this model: at most {room // 8} "
                f"(max_input_len {config.max_input_len})"
            )
        generator = ExLlamaV2DynamicGenerator(
            model=model,
            cache=cache,
            tokenizer=tokenizer,
            max_batch_size=batch,
            max_chunk_size=max_chunk_size,
            paged=paged,
        )
        if warmup:
            generator.warmup()  # kernel autotune before the first real job (dyn:514)

        def grammar_vocab() -> GrammarVocab:
            import llguidance

            text = (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")
            eos = eos_token_ids or [tokenizer.eos_token_id]
            return GrammarVocab(
                llguidance.LLTokenizer(text, n_vocab=config.vocab_size, eos_token=eos)
            )

        return cls(
            generator,
            vocab_size=config.vocab_size,
            api=ExllamaApi.load(),
            on_close=model.unload,
            grammar_vocab=grammar_vocab,
        )

    # --- Engine interface ------------------------------------------------------------

    @property
    def generator(self) -> Any:
        """The wrapped generator (read-only use: benchmarks look at its active jobs)."""
        return self._generator

    @property
    def capacity(self) -> int:
        # Unpaged mode has a single cache page, so one job at a time (dyn:384-391).
        return int(self._generator.max_batch_size) if self._generator.paged else 1

    def has_work(self) -> bool:
        return any(not c.done for job in self._jobs.values() for c in job.choices.values())

    def submit(self, job: EngineJob) -> None:
        if job.job_id in self._jobs:
            raise JobRejected(f"job {job.job_id} is already running")
        self._validate(job)
        filters = self._filters(job)
        api = self._load_api()
        bias = self._token_bias(api, job.sampling.logit_bias)
        state = _Job(job.job_id, job.sampling.logprobs)
        self._jobs[job.job_id] = state
        stop_conditions = sorted(job.all_stop_ids)
        for choice in job.choices:
            c = _Choice(choice.index)
            state.choices[choice.index] = c
            if choice.max_new_tokens <= 0:
                # A resumed choice with nothing left; exllamav2 would still sample one.
                c.pending = TokenDelta(choice.index, [], finish=EngineFinish.LENGTH)
                continue
            c.grammar = filters.get(choice.index)
            try:
                c.exl_job = self._make_job(api, job, choice, bias, stop_conditions, c.grammar)
                self._generator.enqueue(c.exl_job)
            except Exception:
                logger.exception("exllamav2 refused job %s choice %d", job.job_id, choice.index)
                c.exl_job = None
                c.pending = TokenDelta(
                    choice.index, [], finish=EngineFinish.ERROR, error="the engine failed"
                )

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
            for result in self._generator.iterate():
                step = self._map_result(result)
                if step is not None:
                    out.append(step)
        for job_id in [j for j, s in self._jobs.items() if all(c.done for c in s.choices.values())]:
            del self._jobs[job_id]
        return out

    def close(self) -> None:
        for job_id in list(self._jobs):
            self.cancel(job_id)
        self._jobs.clear()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    # --- mapping ---------------------------------------------------------------------

    def _load_api(self) -> ExllamaApi:
        if self._api is None:
            self._api = ExllamaApi.load()
        return self._api

    def _validate(self, job: EngineJob) -> None:
        """Reject up front what exllamav2 would assert on, or what would crash the GPU.

        A job needs ceil((P + M) / page) pages and the cache has cache_tokens / page of
        them (dyn:2258-2290; unpaged: one page of cache_tokens), so P + M <= cache tokens
        in both modes. A token id past the vocabulary would index out of range in the
        embedding kernel, a CUDA error that takes every other job down with it.
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
            if p + m > cache:
                raise JobRejected(
                    f"prompt ({p} tokens) + max_tokens ({m}) exceeds the cache ({cache} tokens)"
                )
            if p + m > context:
                # Rotary tables are sized to the model's max_seq_len.
                raise JobRejected(
                    f"prompt ({p} tokens) + max_tokens ({m}) exceeds the model's "
                    f"context ({context} tokens)"
                )

    def _filters(self, job: EngineJob) -> dict[int, GrammarFilter]:
        """Each choice's grammar filter when the job is constrained (built here so that
        a grammar that cannot be compiled rejects the job as a 400 up front)."""
        constraint = job.sampling.constraint
        if constraint is None:
            return {}
        try:
            if self._grammar_vocab is None:
                if self._grammar_vocab_factory is None:
                    raise ConstraintError("this engine has no tokenizer for output grammars")
                self._grammar_vocab = self._grammar_vocab_factory()
            compiled = JobGrammar(self._grammar_vocab, constraint)
            return {
                c.index: GrammarFilter(compiled.start(c.prefix_ids), c.max_new_tokens)
                for c in job.choices
            }
        except ConstraintError as exc:
            raise JobRejected(str(exc)) from exc
        except Exception as exc:
            logger.exception("cannot build the output grammar of job %s", job.job_id)
            raise JobRejected("the output grammar could not be built") from exc

    def _token_bias(self, api: ExllamaApi, logit_bias: dict[int, float]) -> Any:
        if not logit_bias:
            return None
        clamped = {t: max(-_MAX_BIAS, min(_MAX_BIAS, b)) for t, b in logit_bias.items()}
        # The logits row is padded to a multiple of 32 (dyn:333), the bias must match it.
        return api.token_bias(int(self._generator.padded_vocab_size), clamped)

    def _make_job(
        self,
        api: ExllamaApi,
        job: EngineJob,
        choice: ChoiceJob,
        bias: Any,
        stop_conditions: list[int],
        grammar: GrammarFilter | None = None,
    ) -> Any:
        seed = job.sampling.seed
        # Only constrained jobs pass filters, so an unconstrained job is built exactly
        # as before (exllamav2 refuses filters together with banned strings, dyn:1769).
        extra: dict[str, Any] = {"filters": [grammar]} if grammar is not None else {}
        return api.job_cls(
            # A resumed choice continues from its own tokens; the shared prompt's full
            # pages are still found by hash and reused across choices (dyn:2551).
            input_ids=api.input_ids([*job.prompt_ids, *choice.prefix_ids]),
            max_new_tokens=choice.max_new_tokens,
            # Stop tokens are blocked until this many new tokens exist (dyn:1881-1885);
            # tokens generated before a resume already count towards min_tokens.
            min_new_tokens=max(0, job.min_tokens - len(choice.prefix_ids)),
            gen_settings=sampler_settings(api, job.sampling, bias),
            # Distinct seeds per choice, or n seeded choices would be n copies.
            seed=None if seed is None else seed + choice.index,
            # Ints only: strings would make exllamav2 match stop strings on its own
            # text, which is the streamer's job. An empty list means no stop at all.
            stop_conditions=stop_conditions,
            return_logits=job.sampling.logprobs is not None,
            identifier=(job.job_id, choice.index),
            **extra,
        )

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
            delta = self._delta(c.index, result, state.logprobs)
        except Exception:
            logger.exception("cannot map exllamav2 output of %s choice %d", state.job_id, c.index)
            if not result.get("eos") and c.exl_job is not None:
                self._generator.cancel(c.exl_job)
            delta = TokenDelta(c.index, [], finish=EngineFinish.ERROR, error="the engine failed")
        if delta.finish is not None:
            if c.grammar is not None and c.grammar.error is not None:
                # The filter ended the job on a grammar error (it never raises into
                # the generator): the request's constraint failed, a 400.
                delta.finish = EngineFinish.ERROR
                delta.error = c.grammar.error
                delta.error_code = 400
            c.done = True
            c.exl_job = None
        elif not delta.token_ids:
            return None  # output held back by exllamav2 (incomplete UTF-8, dyn:2137)
        return EngineStep(state.job_id, delta)

    @staticmethod
    def _delta(index: int, result: dict[str, Any], logprobs: int | None) -> TokenDelta:
        # Token ids arrive in result["token_ids"], except what exllamav2 was still
        # holding when the job ended: on a stop token it does not flush its buffer but
        # returns it, stop token included, under result["held"] (dyn:2079-2093, 2121).
        held = result.get("held") or {}
        parts = [p for p in (result.get("token_ids"), held.get("token_ids")) if p is not None]
        token_ids = [t for p in parts for t in _ids(p)]

        lps: list[TokenLogprob] | None = None
        if logprobs is not None and token_ids:
            rows = [
                np.asarray(p)[0]
                for p in (result.get("logits"), held.get("logits"))
                if p is not None
            ]
            logits = np.concatenate(rows, axis=0) if rows else np.empty((0, 0), np.float32)
            if logits.shape[0] != len(token_ids):
                raise ValueError(f"{logits.shape[0]} logit rows for {len(token_ids)} tokens")
            lps = logprobs_from_logits(logits, token_ids, logprobs)

        finish: EngineFinish | None = None
        cached: int | None = None
        if result.get("eos"):
            # "max_new_tokens" is a length stop; "stop_token" (and the unused
            # "stop_string"/"end_filter") end the choice like an EOS (dyn:2121-2132).
            reason = result.get("eos_reason")
            finish = EngineFinish.LENGTH if reason == "max_new_tokens" else EngineFinish.EOS
            cached = result.get("cached_tokens")
        return TokenDelta(index, token_ids, lps, finish, cached_tokens=cached)
