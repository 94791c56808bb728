"""The engine interface every backend implements (exllamav2, llamacpp, echo).

Engines turn prompt token ids into new token ids. They never decode text and never
handle stop strings (the streamer's Decoder does). Only the worker's engine thread calls
an engine, so implementations need no locking, except ``prepare``, which the thread
handing a job over calls (a Celery task's) and which touches nothing the engine thread
changes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from app.messages import TokenDelta
from app.records import SamplingParams


class JobRejected(Exception):
    """The engine cannot run this job (e.g. prompt + max_new_tokens exceed the cache).

    Its message is shown to the client as a 400.
    """


@dataclass(slots=True)
class ChoiceJob:
    """One choice of a job.

    ``prefix_ids`` are tokens this choice already generated before a resume (they are
    appended to the prompt and not published again); ``max_new_tokens`` is what is left.
    """

    index: int
    max_new_tokens: int
    prefix_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineJob:
    """A request as an engine sees it: token ids and sampling, nothing textual.

    ``eos_token_ids`` (the model's, empty when ignore_eos) and ``stop_token_ids`` (the
    user's) both end a choice with ``EngineFinish.EOS``; neither may end it before
    ``min_tokens`` tokens were generated (counting a resumed choice's ``prefix_ids``).
    ``echo_ids`` is only read by the echo engine (the last user message of a chat, or
    None to echo the whole prompt). ``cache_scope`` names whose cached prompt prefixes
    the job may reuse (its model, cache salt and, where keys are isolated, API key):
    engines with a prefix cache reuse KV only between jobs of one scope.
    """

    job_id: str
    prompt_ids: list[int]
    choices: list[ChoiceJob]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    echo_ids: list[int] | None = None
    cache_scope: str = ""
    # The model's own EOS (the first of its end-of-generation ids): what the echo engine
    # ends a choice with.
    eos_token_id: int | None = None
    # What ``Engine.prepare`` made of the job on the submitting thread (its compiled
    # output grammar, or why it cannot be built), so that ``submit``, on the engine's
    # thread, does not spend a step's time on it.
    prepared: Any = None

    @property
    def all_stop_ids(self) -> frozenset[int]:
        return self.eos_token_ids | self.stop_token_ids


@dataclass(slots=True)
class EngineStep:
    """New output of one job for one choice, produced by one ``Engine.step()``."""

    job_id: str
    delta: TokenDelta


class Engine(abc.ABC):
    """Continuous-batching engine driven by a single thread.

    Contract (checked by tests/engines/test_contract.py for every engine that runs here):
    - ``submit`` validates synchronously and raises ``JobRejected`` for jobs that can
      never run; otherwise the job joins the running batch at the next ``step``.
    - ``step`` advances every active job by (at most) one token per choice and returns
      the new ids; a choice's last ``EngineStep`` has ``delta.finish`` set; every choice
      of every submitted job eventually gets exactly one finish.
    - ``cancel`` ends a job: its unfinished choices get ``EngineFinish.CANCELLED`` at the
      next ``step`` and it frees its resources; unknown ids are ignored.
    - A failure of one job is reported as ``EngineFinish.ERROR`` on its choices, never
      raised out of ``step`` (an exception from ``step`` means the engine itself broke).
    """

    name: str = "engine"

    def prepare(self, job: EngineJob) -> None:  # noqa: B027 - optional hook
        """Do a job's costly preparation (compiling its output grammar) on the thread
        that hands it over, before ``submit``: work here delays only this job, work in
        ``submit`` delays every running one by a step (and their leases with it). Never
        raises for the job's own faults: ``submit`` rejects it."""

    @abc.abstractmethod
    def submit(self, job: EngineJob) -> None: ...

    @abc.abstractmethod
    def cancel(self, job_id: str) -> None: ...

    @abc.abstractmethod
    def step(self) -> list[EngineStep]: ...

    @abc.abstractmethod
    def has_work(self) -> bool:
        """True while any submitted job still has unfinished choices."""

    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """How many sequences (choices) it batches at once at most."""

    @property
    def mode(self) -> str:
        """How this engine instance batches, for operators: exllamav2 says ``paged`` or
        ``unpaged`` (one sequence at a time, whatever ``capacity`` the settings asked
        for). Shown in the start-up log, /metrics, /ready and Flower, so a worker that
        silently serves one request at a time is visible. Read once at start-up."""
        return "batched"

    def stats(self) -> dict[str, float]:
        """Engine-specific gauges for monitoring, e.g. ``cache_usage`` (0..1).

        Called from the engine thread only (like everything else here)."""
        return {}

    def prefix_blocks(self) -> frozenset[bytes] | None:
        """The names (``app.prefix_blocks``) of every prompt prefix this engine can start
        a job from without prefilling it, for the web tier to route a conversation's
        next turn here (``broker.prefix_routes``); None when it keeps no prefix cache
        to route to. Called from the engine thread, between steps."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the engine's resources."""
