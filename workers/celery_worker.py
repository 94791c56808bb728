"""The Celery worker module: ``celery -A workers.celery_worker worker -P threads``.

``build_app(settings)`` registers the ``generate`` task on the app from
``broker.celery_app`` and starts the engine once per worker process in ``worker_init``
(the model loads before any task). ``tokenrelay worker`` (``workers.__main__``) calls it
with the settings it was given; the module attribute ``app``, which ``celery -A``
looks up, is built from the environment only when something asks for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any

from celery import Celery, bootsteps
from celery.signals import (
    celeryd_init,
    setup_logging,
    worker_init,
    worker_shutdown,
    worker_shutting_down,
)
from celery.worker.consumer import Consumer
from vine import promise

from app import logs
from app.errors import ModelError
from app.model_card import load_model_card
from app.settings import Settings
from broker import tracing
from broker.celery_app import GENERATE_TASK, celery_redis, create_celery, requeue_own
from broker.connection import worker_shards
from broker.embeddings import EMBED_TASK
from workers.embedder import can_embed
from workers.runtime import WorkerRuntime, new_worker_id

# The exit status of a worker whose engine broke (the circuit breaker): not 0, so every
# supervisor restarts it; not 3 (an engine that could not start at all).
EXIT_BROKEN = 4

logger = logging.getLogger(__name__)

# kombu retries a lost broker after 2 s, then 4, 6, ... up to 30 s apart: after a long
# outage a worker would sit idle up to 30 s with Redis back. Retrying every 0.5-1 s
# costs nothing (a refused TCP connect) and brings the worker back within a second.
RECONNECT_INTERVALS = {"interval_start": 0.5, "interval_step": 0.5, "interval_max": 1.0}

# Celery flushes the worker's buffered task events (received, started, succeeded) on
# the loop's next turn: one PUBLISH round trip on the consumer's thread for almost
# every event, half of that thread's time in a burst of requests (docs/benchmarks.md).
# Letting them gather this long sends one message for all of them; Flower and
# ``celery events`` see each event at most this much later.
EVENT_LINGER_S = 0.05


class BrokerConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer, reconnecting to a lost broker at ``RECONNECT_INTERVALS``.

    Celery calls ``conn.ensure_connection`` with kombu's default intervals and no way
    to set them; this passes ours for the duration of that one call (the worker setting
    ``worker_consumer`` names this class). Its task events go out at most every
    ``EVENT_LINGER_S`` instead of on every turn of the loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._event_flush_due = False
        self._linger_promise = promise(self._flush_events_later)

    def on_send_event_buffered(self) -> None:
        # Any thread may buffer an event; call_soon is the hub's thread-safe entry.
        if self.hub:
            self.hub.call_soon(self._linger_promise)

    def _flush_events_later(self) -> None:
        # On the hub's thread: one timer at a time, so a flush covers what it gathered.
        if not self._event_flush_due:
            self._event_flush_due = True
            self.hub.call_later(EVENT_LINGER_S, self._flush_lingered)

    def _flush_lingered(self) -> None:
        self._event_flush_due = False
        self._flush_events()

    def ensure_connected(self, conn: Any) -> Any:
        ensure = conn.ensure_connection

        def ensure_quickly(*args: Any, **kwargs: Any) -> Any:
            for name, value in RECONNECT_INTERVALS.items():
                kwargs.setdefault(name, value)
            return ensure(*args, **kwargs)

        conn.ensure_connection = ensure_quickly
        try:
            return super().ensure_connected(conn)
        finally:
            del conn.ensure_connection


class KeepUnackedOnClose(bootsteps.StartStopStep):  # type: ignore[misc]
    """Do not "restore" the task channel's unacknowledged messages when it closes.

    On a lost connection kombu would re-publish the messages of the tasks still running
    here; Redis is away, so it fails, logs "UNABLE TO RESTORE" and dumps them to a file
    in the temp dir, once per outage. They need no restoring: those tasks go on, and a
    request a worker never ran is resent by the streamers. At a warm shutdown Celery
    lets running tasks finish, and with a prefetch of one per thread no message waits
    unstarted, so there is nothing to restore either."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        if c.task_consumer is not None:
            c.task_consumer.channel.qos.restore_at_shutdown = False


def engine_info_step(state: dict[str, WorkerRuntime]) -> type[bootsteps.Step]:
    """A worker bootstep whose ``info`` adds the engine's identity to the worker's stats.

    ``celery inspect stats`` merges every bootstep's ``info()`` into its answer, and
    Flower shows the keys it does not know on the worker page's "Other" tab: engine,
    mode (paged/unpaged), capacity and slots, next to Celery's own pool and queues."""

    # A StartStopStep (starting and stopping nothing): only those are added to the
    # worker's ``steps``, the list whose ``info()`` the stats merge.
    class EngineInfo(bootsteps.StartStopStep):  # type: ignore[misc]
        name = "tokenrelay.EngineInfo"

        def info(self, worker: Any) -> dict[str, Any]:
            runtime = state.get("runtime")
            return dict(runtime.describe()) if runtime is not None else {}

    return EngineInfo


def hand_back(celery_app: Celery, runtime: WorkerRuntime) -> None:
    """Send the turns routed to this worker that no thread took to the shared queue."""
    tokens = runtime.store.redis
    queues = celery_redis(runtime.settings, tokens, max_connections=1)
    try:
        moved = requeue_own(celery_app, queues, runtime.model_name, runtime.worker_id)
    except Exception as exc:  # the streamers' watchdog resends them anyway
        logger.warning("could not hand this worker's queue back: %s", exc)
    else:
        if moved:
            logger.info("sent %d queued requests on to the shared queue", moved)
    finally:
        if queues is not tokens:
            queues.connection_pool.disconnect()


def say(message: str) -> None:
    """A last word before ``os._exit``: on stderr as it is, or as a JSON log line."""
    if logs.json_enabled():
        logger.critical("%s", message)
    else:
        sys.stderr.write(f"tokenrelay worker: {message}\n")
        sys.stderr.flush()


def exit_broken(reason: str) -> None:
    """End the process with ``EXIT_BROKEN``, saying why on stderr (the log may be gone)."""
    say(f"the engine is broken ({reason}); exiting")
    os._exit(EXIT_BROKEN)


def json_worker_logs(celery_app: Celery) -> None:
    """With ``log_format`` json, Celery prints nothing but JSON lines: it leaves logging
    to ``app.logs`` (a ``setup_logging`` receiver, which also keeps it from redirecting
    stdout and stderr into its loggers), here and under ``celery -A ... worker``, and
    the notices its signal handlers write straight to stdout ("worker: Warm shutdown")
    become JSON lines on stderr; its start-up banner (stdout) is not printed."""
    from celery.apps import worker as celery_worker_program

    def _configure(loglevel: Any = None, **_: Any) -> None:
        level = loglevel if isinstance(loglevel, (int, str)) and loglevel else logging.INFO
        logs.configure("worker", level, "json")

    def _before_engine(instance: Any = None, options: Any = None, **_: Any) -> None:
        # ``celeryd_init`` comes before ``worker_init`` (the engine's start), which
        # comes before Celery's own logging set-up.
        if getattr(instance, "app", celery_app) is celery_app:
            _configure((options or {}).get("loglevel"))
            instance.quiet = True  # as --quiet: no banner

    def _say_as_json(msg: str, f: Any = None) -> None:
        # In a signal handler, as Celery's ``safe_say``: one os.write, no logging locks.
        record = logging.makeLogRecord(
            {"name": "celery.apps.worker", "levelname": "INFO", "levelno": logging.INFO,
             "msg": msg.strip()}
        )  # fmt: skip
        with contextlib.suppress(OSError):
            os.write(2, (logs.JsonFormatter("worker").format(record) + "\n").encode())

    setup_logging.connect(_configure, weak=False)
    celeryd_init.connect(_before_engine, weak=False)
    celery_worker_program.safe_say = _say_as_json


def build_app(settings: Settings) -> Celery:
    """The worker's app; ``app.tokenrelay_worker_id`` names the worker (its registry
    entry, step stream and own queue, which the app consumes first)."""
    worker_id = new_worker_id()
    tracing.start("worker")
    try:
        embeds = can_embed(settings, load_model_card(settings.card_path()))
    except ModelError:  # the engine's start says why, and exits (worker_init)
        embeds = False
    shards, home = worker_shards(settings)  # a Redis Cluster's: its home shard's queues first
    celery_app = create_celery(
        settings, worker_id=worker_id, embeds=embeds, shards=shards, home=home
    )
    celery_app.tokenrelay_home = home
    if settings.log_format == "json":
        json_worker_logs(celery_app)
    celery_app.conf.worker_consumer = f"{__name__}:BrokerConsumer"
    celery_app.steps["consumer"].add(KeepUnackedOnClose)
    state: dict[str, WorkerRuntime] = {}
    celery_app.steps["worker"].add(engine_info_step(state))

    @celery_app.task(name=GENERATE_TASK, bind=True)  # type: ignore[untyped-decorator]
    def generate(
        self: Any, request_id: str, attempt: int = 0, fair: bool = False
    ) -> dict[str, Any]:
        runtime = state.get("runtime")
        if runtime is None:
            raise RuntimeError("worker runtime not started (worker_init did not run)")
        return runtime.generate(request_id, attempt, fair=fair).encode()

    @celery_app.task(name=EMBED_TASK)  # type: ignore[untyped-decorator]
    def embed(request_id: str, inputs: list[list[int]]) -> int:
        runtime = state.get("runtime")
        if runtime is None:
            raise RuntimeError("worker runtime not started (worker_init did not run)")
        return runtime.embed(request_id, inputs)

    def _ours(sender: Any) -> bool:
        # The signals are process-wide: answer only for a worker of this app.
        return getattr(sender, "app", celery_app) is celery_app

    def _start(sender: Any = None, **_: Any) -> None:
        if not _ours(sender):
            return
        try:
            runtime = WorkerRuntime.from_settings(
                settings, worker_id=worker_id, home=home if shards else -1
            )
        except Exception as exc:
            # Celery would log a signal-handler error and keep consuming tasks it cannot
            # run; a worker without its engine must stop, loudly, so supervisors see it.
            logger.critical("cannot start the %s engine: %s", settings.engine, exc, exc_info=True)
            if not logs.json_enabled():  # else that line is the last word
                say(f"cannot start the {settings.engine} engine: {exc}")
            os._exit(3)
        runtime.on_broken = _broken
        runtime.start()
        state["runtime"] = runtime

    def _stop(sender: Any = None, **_: Any) -> None:
        if not _ours(sender):
            return
        runtime = state.pop("runtime", None)
        if runtime is not None:
            runtime.stop()
            hand_back(celery_app, runtime)

    def _drain(sender: Any = None, how: str = "Warm", **_: Any) -> None:
        # SIGTERM (Celery's warm shutdown): Celery stops taking jobs and waits for the
        # running ones; the runtime hands them over when ``drain_s`` runs out, so the
        # wait is bounded. A cold shutdown (SIGQUIT, a second SIGINT) does not drain.
        # Redis calls do not belong in a signal handler: a thread of its own does them.
        runtime = state.get("runtime")
        if runtime is not None and how == "Warm":

            def drain() -> None:
                runtime.drain(settings.drain_s)
                hand_back(celery_app, runtime)

            threading.Thread(target=drain, name="drain", daemon=True).start()

    def _broken(reason: str) -> None:
        # The engine is unusable (WorkerRuntime._watch has stopped it): a worker that
        # heart-beats on would be sent requests only to fail them. Exit non-zero, for
        # the supervisor (compose, Kubernetes, ``tokenrelay up``) to start a new one.
        runtime = state.pop("runtime", None)
        if runtime is not None:
            hand_back(celery_app, runtime)
        exit_broken(reason)

    worker_init.connect(_start, weak=False)
    worker_shutdown.connect(_stop, weak=False)
    worker_shutting_down.connect(_drain, weak=False)
    celery_app.tokenrelay_state = state
    celery_app.tokenrelay_worker_id = worker_id
    celery_app.tokenrelay_embeds = embeds
    return celery_app


_default: dict[str, Celery] = {}


def __getattr__(name: str) -> Celery:
    """``app`` for ``celery -A workers.celery_worker``: built from the environment on
    first use, so importing ``build_app`` builds nothing."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if "app" not in _default:
        _default["app"] = build_app(Settings())
    return _default["app"]
