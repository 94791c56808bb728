"""Per-choice state of the exllamav2 engine: segments, output penalties, result mapping.

``ExLlamaV2Engine`` (workers/engines/exllamav2.py) runs each choice of a tokenrelay job
as ``ExLlamaV2DynamicJob`` objects; this module holds what a choice carries between
them and turns the generator's result dicts into ``TokenDelta`` values. Like the engine,
it never imports exllamav2 or torch.

**Segments: bounded page reservation.** exllamav2 reserves the pages of
prompt + ``max_new_tokens`` when a job starts (dyn:2260, allocate_pages dyn:2534) and a
job waits while those pages are not free (dyn:1314). With tokenrelay's default
``max_tokens`` (context - prompt) a 32k-context model held 2 sequences in a 64k-token
cache whatever their real length. So a choice runs as successive jobs ("segments") of at
most ``segment_tokens`` new tokens. When a segment ends with ``eos_reason ==
"max_new_tokens"`` (its held output flushed, dyn:2127) while the choice has tokens left,
the next one is enqueued on prompt + everything generated and no finish is reported.
Its prefill is nearly free: each full page was hashed as it filled (dyn:1954-1994) and
is found again by hash (dyn:2551-2559); the partial last page's keys and values are
copied from the page the previous segment left (dyn:2374-2391).

What crosses a segment boundary: the random generator (``job.rng``, dyn:1740, one draw
per token, dyn:1892), so a seeded choice draws the same numbers as one long job; the
grammar filter object with its state; ``min_new_tokens`` less what was generated; the
stop ids; the sampler settings with the output penalties; the first segment's
``cached_tokens``; and cancel, which always targets the current segment's job. A
sequence can never outgrow the cache: the last segment is cut to the room left and the
choice then finishes with ``length``.

**Output penalties.** exllamav2's presence/frequency penalties count the prompt too
(``token_repetition_range`` -1 covers the whole sequence, cpp/sampling.cpp
apply_rep_penalty); OpenAI's and the llama.cpp engine's count generated tokens only.
``OutputPenalties`` keeps them in the choice's own ``token_bias`` tensor, which the
sampler adds to the logits at every sample (smp:429), updated in place after each step.
It counts from the job's sequence (``sequences[0].sequence_ids``, where every sampled
token is appended, dyn:1945) rather than from the emitted ids, which lag while exllamav2
holds back an incomplete UTF-8 character (dyn:2137).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from app.messages import EngineFinish, TokenDelta, TokenLogprob
from app.records import SamplingParams
from workers.engines.base import EngineJob
from workers.engines.exllamav2_filter import GrammarFilter
from workers.engines.exllamav2_startup import PAGE_SIZE
from workers.engines.logprobs import token_logprobs

if TYPE_CHECKING:
    from workers.engines.exllamav2 import ExllamaApi

# OpenAI caps logit_bias at +-100; exllamav2 adds the bias to the logits as is (smp:429).
_MAX_BIAS = 100.0

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
        # exllamav2 applies these over prompt + output (range -1): right for
        # repetition_penalty (as HF, vLLM and the llama.cpp engine apply it), wrong for
        # OpenAI's presence/frequency penalties, which count generated tokens only and
        # live in the choice's token_bias (OutputPenalties). 1.0 / 0.0 / 0.0 skip the
        # penalty pass entirely (smp:408).
        token_repetition_penalty=sampling.repetition_penalty,
        token_presence_penalty=0.0,
        token_frequency_penalty=0.0,
        token_bias=token_bias,
    )


def clamped_bias(logit_bias: dict[int, float]) -> dict[int, float]:
    """logit_bias as exllamav2 gets it: OpenAI's range, +-100."""
    return {t: max(-_MAX_BIAS, min(_MAX_BIAS, b)) for t, b in logit_bias.items()}


def ids_of(tensor: Any) -> list[int]:
    """Token ids of a (1, n) tensor (torch in production, anything with tolist in tests)."""
    return [int(t) for t in tensor.tolist()[0]]


class OutputPenalties:
    """OpenAI's presence/frequency penalties over one choice's generated tokens.

    ``tensor`` is the choice's ``token_bias`` (padded vocab, float32), which also holds
    the request's ``logit_bias`` (``base``); each token's entry is kept at
    ``base - (frequency * count + presence * (count > 0))``, the formula OpenAI
    documents and llama.cpp applies. Only choices with a nonzero penalty get one.
    """

    def __init__(
        self, tensor: Any, base: dict[int, float], *, presence: float, frequency: float
    ) -> None:
        self.tensor = tensor
        self.base = base
        self.presence = presence
        self.frequency = frequency
        self.counts: dict[int, int] = {}
        self.seen = 0  # positions of the current segment's sequence already counted

    @staticmethod
    def wanted(sampling: SamplingParams) -> bool:
        return sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0

    def count(self, tokens: Iterable[int]) -> None:
        for tok in tokens:
            n = self.counts.get(tok, 0) + 1
            self.counts[tok] = n
            self.tensor[tok] = self.base.get(tok, 0.0) - (self.frequency * n + self.presence)

    def follow(self, input_len: int) -> None:
        """A new segment starts on ``input_len`` ids, all of them counted already."""
        self.seen = input_len

    def observe(self, exl_job: Any) -> None:
        """Count what ``exl_job`` sampled since the last look, held-back tokens included."""
        seq = exl_job.sequences[0].sequence_ids
        n = len(seq)
        if n > self.seen:
            self.count(ids_of(seq.torch_slice(self.seen, n)))
            self.seen = n


@dataclass(slots=True)
class _Choice:
    """One choice across its segments (see the module docstring)."""

    index: int
    prompt: list[int]  # the job's prompt, shared by its choices
    generated: list[int]  # a resumed prefix, then every token reported since
    left: int  # new tokens the choice may still generate
    exl_job: Any = None  # the current segment's ExLlamaV2DynamicJob
    done: bool = False
    grammar: GrammarFilter | None = None  # a constrained choice's filter
    penalties: OutputPenalties | None = None
    settings: Any = None  # ExLlamaV2Sampler.Settings, shared by the segments
    segments: int = 0
    cached_tokens: int | None = None  # the first segment's prompt cache hits
    told_cached: bool = False  # a delta of this choice carried its cache hits
    # A finish decided outside the generator (cancel, error, nothing left to generate),
    # reported at the next step() so that every finish goes out the same way.
    pending: TokenDelta | None = None

    def context(self) -> list[int]:
        """The next segment's input: prompt + prefix + everything generated so far."""
        return [*self.prompt, *self.generated]

    def segment_length(self, segment_tokens: int, cache_tokens: int) -> int:
        """New tokens the next segment may reserve: what is left, at most one segment
        (0 = no bound), and never past the cache, which one sequence cannot outgrow."""
        n = min(self.left, cache_tokens - len(self.prompt) - len(self.generated))
        return min(n, segment_tokens) if segment_tokens > 0 else n


@dataclass(slots=True)
class _Job:
    job_id: str
    job: EngineJob
    stop_conditions: list[int]
    choices: dict[int, _Choice] = field(default_factory=dict)

    @property
    def logprobs(self) -> int | None:
        return self.job.sampling.logprobs


def raw_logits(
    rows: np.ndarray,
    tokens: list[int],
    context: list[int],
    generated: list[int],
    sampling: SamplingParams,
) -> np.ndarray:
    """The model's own logits back from the rows ``return_logits`` gives.

    exllamav2 returns each row after its sampler changed it in place (smp:408-429): the
    repetition penalty over the whole sequence, then the token bias (the request's
    logit_bias and, in ``OutputPenalties``, the presence/frequency penalties as they were
    when that token was sampled). Both engines report the log-softmax of the raw logits
    (the llama.cpp engine reads them before its sampler chain, as vLLM does), so this
    undoes them, in reverse order: row ``i`` was sampled after ``context + tokens[:i]``
    (``generated``: the choice's output so far, a resumed prefix included). What the
    sampler set to -1e30 or -inf (stop ids under min_tokens, a grammar's forbidden ids)
    stays there: never a sampled token, only an alternative reported at the floor.
    """
    out = np.array(rows, dtype=np.float64)
    bias = clamped_bias(sampling.logit_bias)
    wanted = OutputPenalties.wanted(sampling)
    repetition = sampling.repetition_penalty
    for i in range(out.shape[0]):
        row = out[i]
        for tok, b in bias.items():
            row[tok] -= b
        if wanted:
            ids, counts = np.unique(
                np.asarray([*generated, *tokens[:i]], dtype=np.int64), return_counts=True
            )
            row[ids] += sampling.frequency_penalty * counts + sampling.presence_penalty
        if repetition != 1.0:
            seen = np.unique(np.asarray([*context, *tokens[:i]], dtype=np.int64))
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals * repetition, vals / repetition)
    return out


def adjusted(sampling: SamplingParams) -> bool:
    """Whether exllamav2's returned logits differ from the model's (``raw_logits``)."""
    return (
        bool(sampling.logit_bias)
        or OutputPenalties.wanted(sampling)
        or (sampling.repetition_penalty != 1.0)
    )


def prompt_cache_hits(exl_job: Any, page_size: int) -> int | None:
    """The ``cached_tokens`` exllamav2 reports when ``exl_job`` ends (dyn:2069-2070),
    read from the job once its prefill is done (it counts pages and tokens found while
    prefilling, dyn:2357, 2410, 2617): the same figure, known with the first token.
    None where the job does not keep those counts."""
    pages = getattr(exl_job, "cached_pages", None)
    tokens = getattr(exl_job, "cached_tokens", None)
    sequences = getattr(exl_job, "sequences", None)
    if not isinstance(pages, int) or not isinstance(tokens, int) or not sequences:
        return None
    return (pages * page_size + tokens) // len(sequences)


def result_delta(
    index: int,
    result: dict[str, Any],
    logprobs: int | None,
    unadjust: Callable[[np.ndarray, list[int]], np.ndarray] | None = None,
) -> TokenDelta:
    """One streaming result dict (dyn:916-985) -> the choice's TokenDelta
    (``unadjust(rows, tokens)``: the raw logits of the rows, ``raw_logits``)."""
    # Token ids arrive in result["token_ids"], except what exllamav2 was still
    # holding when the job ended: on a stop token it does not flush its buffer but
    # returns it, stop token included, under result["held"] (dyn:2079-2093, 2121).
    held = result.get("held") or {}
    parts = [p for p in (result.get("token_ids"), held.get("token_ids")) if p is not None]
    token_ids = [t for p in parts for t in ids_of(p)]

    lps: list[TokenLogprob] | None = None
    if logprobs is not None and token_ids:
        rows = [
            np.asarray(p)[0] for p in (result.get("logits"), held.get("logits")) if p is not None
        ]
        logits = np.concatenate(rows, axis=0) if rows else np.empty((0, 0), np.float32)
        if logits.shape[0] != len(token_ids):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(token_ids)} tokens")
        if unadjust is not None:
            logits = unadjust(logits, token_ids)
        # exllamav2's return_probs/return_top_tokens are after temperature and
        # truncation (ext:239-284): greedy would report 0 and -inf for everything.
        lps = token_logprobs(logits, token_ids, logprobs)

    finish: EngineFinish | None = None
    cached: int | None = None
    if result.get("eos"):
        # "max_new_tokens" is a length stop (or a segment's end, which the engine
        # continues); "stop_token" and "end_filter" (a completed grammar) end the choice
        # like an EOS; "stop_string" never occurs, no strings are passed (dyn:2121-2132).
        reason = result.get("eos_reason")
        finish = EngineFinish.LENGTH if reason == "max_new_tokens" else EngineFinish.EOS
        cached = result.get("cached_tokens")
    return TokenDelta(index, token_ids, lps, finish, cached_tokens=cached)


def generator_stats(generator: Any, jobs: Iterable[_Job], paged: bool) -> dict[str, float]:
    """The engine's gauges (``Engine.stats``): ``cache_usage``, the fraction of the
    cache's pages running jobs hold (pages that keep only a finished prefix are free to
    take); ``engine_waiting``, jobs waiting inside exllamav2 for pages or a batch slot;
    ``pending_continuations``, those of them continuing a live stream (paused until its
    next segment gets pages)."""
    pending = {id(j) for j in generator.pending_jobs}
    continuing = sum(
        1
        for state in jobs
        for c in state.choices.values()
        if c.segments > 1 and c.exl_job is not None and id(c.exl_job) in pending
    )
    pages = max(int(generator.max_total_tokens) // PAGE_SIZE, 1) if paged else 1
    return {
        "cache_usage": min(len(generator.referenced_pages) / pages, 1.0),
        "engine_waiting": float(len(pending)),
        "pending_continuations": float(continuing),
    }
