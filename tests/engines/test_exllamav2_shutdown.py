"""Shutdown and worker identity of an exllamav2 worker, without a GPU (issue 15 items 5, 1).

- Item 5: ``WorkerRuntime.stop`` never closes the engine while the engine thread is
  still inside a step (a stand-in generator whose ``iterate`` blocks), and closes it
  once that thread has ended; no other thread ever calls the generator.
- Item 1: the engine's mode and capacity reach the start-up log, the heartbeat and
  Flower's worker stats (through a Celery bootstep).
"""

from __future__ import annotations

import logging
import threading
import time
import types
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from celery import bootsteps
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.model_card import ModelCard
from app.settings import Settings
from tests.engines.exllamav2_standin import VOCAB, StandInDynamicGenerator, stand_in_api
from workers.celery_worker import build_app, engine_info_step
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.exllamav2 import ExLlamaV2Engine
from workers.engines.exllamav2_startup import StartupPlan
from workers.runtime import WorkerRuntime
from workers.work_items import WorkItem

# --- item 5: shutdown never races the engine thread ----------------------------------------


class BlockingGenerator(StandInDynamicGenerator):
    """A generator whose ``iterate`` blocks until released, recording every caller."""

    def __init__(self) -> None:
        super().__init__(cache_tokens=4096, max_batch_size=8)
        self.callers: set[int] = set()
        self.stepping = threading.Event()
        self.release = threading.Event()

    def enqueue(self, job: Any) -> int:
        self.callers.add(threading.get_ident())
        return super().enqueue(job)

    def cancel(self, job: Any) -> None:
        self.callers.add(threading.get_ident())
        super().cancel(job)

    def iterate(self) -> list[dict[str, Any]]:
        self.callers.add(threading.get_ident())
        self.stepping.set()
        assert self.release.wait(10), "never released"
        return super().iterate()


class CountingEngine(ExLlamaV2Engine):
    def __init__(self, generator: Any) -> None:
        self.closed_by: list[int] = []
        super().__init__(generator, vocab_size=VOCAB, api=stand_in_api(), on_close=self._closed)

    def _closed(self) -> None:
        self.closed_by.append(threading.get_ident())


def runtime_for(engine: ExLlamaV2Engine) -> WorkerRuntime:
    """A worker runtime whose Redis is unreachable (refused at once, no retries): the
    engine thread keeps stepping and its publishes back off, as in a Redis outage."""
    client = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    settings = Settings(served_model_name="m", worker_slots=4)
    card = cast(
        ModelCard,
        types.SimpleNamespace(
            eos_token_ids=[2], path=Path("m"), context_length=8192, gguf_file=None
        ),
    )
    return WorkerRuntime(settings, card, engine, client)


def submit(runtime: WorkerRuntime) -> None:
    job = EngineJob("r1/0.0/0", [1, 2, 3], [ChoiceJob(0, 50)])
    runtime.thread.submit(WorkItem("r1", 0, "lease", [job], deadline=time.time() + 60))


def test_stop_does_not_close_an_engine_whose_thread_is_still_in_a_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gen = BlockingGenerator()
    engine = CountingEngine(gen)
    runtime = runtime_for(engine)
    runtime.stop_join_s = 0.2
    runtime.start()
    submit(runtime)
    assert gen.stepping.wait(5)
    with caplog.at_level(logging.ERROR):
        runtime.stop()  # the join times out: the step is still running
    assert runtime.thread.is_alive()
    assert engine.closed_by == [] and engine.generator is gen
    assert "left open" in caplog.text
    gen.release.set()
    runtime.thread.join(5)
    assert not runtime.thread.is_alive()
    assert gen.callers == {runtime.thread.ident}  # no other thread ever touched it
    assert engine.closed_by == []  # left to the process exit


def test_stop_closes_the_engine_once_its_thread_has_ended(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gen = BlockingGenerator()
    gen.release.set()
    engine = CountingEngine(gen)
    runtime = runtime_for(engine)
    with caplog.at_level(logging.INFO):
        runtime.start()
    assert "mode paged, capacity 8 sequences, 4 slots" in caplog.text
    submit(runtime)
    assert gen.stepping.wait(5)
    runtime.stop()
    assert not runtime.thread.is_alive()
    assert engine.closed_by == [threading.get_ident()]
    assert engine.generator is None
    # Whatever the generator still had was cancelled before the engine let go of it.
    assert gen.num_remaining_jobs() == 0


def test_flower_shows_the_engine_mode_and_capacity() -> None:
    engine = CountingEngine(StandInDynamicGenerator(max_batch_size=8, paged=False))
    runtime = runtime_for(engine)
    state = {"runtime": runtime}
    step = engine_info_step(state)(parent=None)
    stats = step.info(None)
    assert stats["tokenrelay_engine"] == "exllamav2"
    assert stats["tokenrelay_engine_mode"] == "unpaged"
    assert stats["tokenrelay_engine_capacity"] == 1
    assert stats["tokenrelay_worker_slots"] == 4
    assert engine_info_step({})(parent=None).info(None) == {}
    # As Celery's worker builds it: the blueprint applies the step to the worker, and the
    # worker's stats merge the info of every step in ``worker.steps``.
    worker = types.SimpleNamespace(steps=[])
    blueprint = bootsteps.Blueprint([engine_info_step(state)], name="worker")
    blueprint.apply(worker)
    assert blueprint.info(worker)["tokenrelay_engine_mode"] == "unpaged"
    app = build_app(Settings(served_model_name="m"))
    assert "tokenrelay.EngineInfo" in {s.name for s in app.steps["worker"]}
    info = runtime.info()
    assert (info.mode, info.engine_capacity, info.capacity) == ("unpaged", 1, 4)


def test_engines_without_modes_say_batched() -> None:
    plan = StartupPlan(paged=True, max_batch_size=4, cache_tokens=1024, max_chunk_size=None)
    assert (plan.mode, plan.capacity) == ("paged", 4)
    from workers.engines.echo import EchoEngine

    assert EchoEngine(tokens_per_second=0, max_batch=4, context_length=64).mode == "batched"
