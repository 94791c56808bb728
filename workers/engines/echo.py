"""The echo engine: a real engine with no model, for tests, demos and relay benchmarks.

Each choice's completion is ``echo_ids`` (the web tier puts the last user message
there for chats) or else the prompt's own ids, followed by the model's first EOS id.
It honours max_new_tokens, min_tokens, user stop token ids, n, resume prefixes and
cancel, at a configurable rate: steps per second, each advancing every running choice
by one token as a real engine's batched step does (0 = as fast as the caller steps).
Logprobs are exact for a deterministic model: 0.0 for the echoed token, alternatives at
-9999.0 (vLLM's stand-in for -inf, which JSON cannot carry).
An output constraint (``SamplingParams.constraint``) is ignored: the output is the
prompt, so tests of tool calls and structured outputs choose the model's text exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from app.messages import EngineFinish, TokenDelta, TokenLogprob
from workers.engines.base import Engine, EngineJob, EngineStep, JobRejected

NEG_INF_LOGPROB = -9999.0


@dataclass(slots=True)
class _Choice:
    job_id: str
    index: int
    source: list[int]
    pos: int  # tokens generated so far, including a resumed prefix
    limit: int  # pos at which max_new_tokens is reached
    job: EngineJob
    cancelled: bool = False


class EchoEngine(Engine):
    name = "echo"

    def __init__(
        self,
        *,
        tokens_per_second: float = 0.0,
        max_batch: int = 256,
        context_length: int = 8192,
        vocab_size: int = 49152,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self.max_batch = max_batch
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.clock = clock
        self.sleep = sleep
        self._choices: list[_Choice] = []
        self._next_step = 0.0

    @property
    def capacity(self) -> int:
        return self.max_batch

    def submit(self, job: EngineJob) -> None:
        source = job.echo_ids if job.echo_ids else job.prompt_ids
        if not source:
            raise JobRejected("the echo engine needs a non-empty prompt")
        for c in job.choices:
            total = len(job.prompt_ids) + len(c.prefix_ids) + c.max_new_tokens
            if total > self.context_length:
                raise JobRejected(
                    f"prompt ({len(job.prompt_ids) + len(c.prefix_ids)} tokens) + max_tokens "
                    f"({c.max_new_tokens}) exceeds the context ({self.context_length} tokens)"
                )
        for c in job.choices:
            pos = len(c.prefix_ids)
            self._choices.append(
                _Choice(job.job_id, c.index, source, pos, pos + c.max_new_tokens, job)
            )

    def cancel(self, job_id: str) -> None:
        for c in self._choices:
            if c.job_id == job_id:
                c.cancelled = True

    def has_work(self) -> bool:
        return bool(self._choices)

    def _token_at(self, c: _Choice) -> tuple[int, bool]:
        """The token at position ``c.pos`` and whether it ends the choice (EOS/stop id)."""
        job = c.job
        n = len(c.source)
        eos = job.eos_token_id
        if eos is None and job.eos_token_ids:
            eos = min(job.eos_token_ids)
        if eos is not None and c.pos >= job.min_tokens and c.pos >= n:
            return eos, True
        tok = c.source[c.pos % n]
        return tok, c.pos + 1 > job.min_tokens and tok in job.all_stop_ids

    def step(self) -> list[EngineStep]:
        if self.interval and self._choices:
            # Like a real engine, one step advances every running choice at once; the
            # rate sets how often steps happen.
            wait = self._next_step - self.clock()
            if wait > 0 and not any(c.cancelled for c in self._choices):
                self.sleep(wait)
            now = self.clock()
            self._next_step = max(self._next_step + self.interval, now)
        out: list[EngineStep] = []
        keep: list[_Choice] = []
        for c in self._choices:
            if c.cancelled:
                out.append(
                    EngineStep(c.job_id, TokenDelta(c.index, [], finish=EngineFinish.CANCELLED))
                )
                continue
            tok, ends = self._token_at(c)
            c.pos += 1
            finish = (
                EngineFinish.EOS if ends else (EngineFinish.LENGTH if c.pos >= c.limit else None)
            )
            lps = None
            k = c.job.sampling.logprobs
            if k is not None:
                top = [(tok, 0.0)] + [
                    ((tok + j) % self.vocab_size, NEG_INF_LOGPROB) for j in range(1, k)
                ]
                lps = [TokenLogprob(tok, 0.0, top[:k])]
            out.append(EngineStep(c.job_id, TokenDelta(c.index, [tok], lps, finish)))
            if finish is None:
                keep.append(c)
        self._choices = keep
        return out
