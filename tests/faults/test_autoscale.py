"""A test that plays the autoscaler (issue 43): KEDA's ScaledObject for one model, as
``deploy/k8s`` configures it, against real processes.

The loop reads what the ScaledObject's triggers read: the lengths of the model's
Celery queue lists (``priority_lists`` of ``tr.interactive.<model>`` and
``tr.batch.<model>``, summed as its ``scalingModifiers`` formula sums them). While the
queue holds requests it starts workers (``tokenrelay worker``, echo engine), up to
``ceil(length / TARGET)`` and ``MAX_REPLICAS``; once the queue has been empty for
``COOLDOWN_S`` it scales in by one, with SIGTERM, whether that worker is busy or not
(the queue does not show running requests: an HPA scales in the same way), and so on
down to zero replicas.

What must hold: a burst of 16 streams against the model at zero replicas waits
(``model_wait_s``) instead of failing, and every stream gets its exact text, through
scale-out, scale-in during streams (the drained worker hands its requests over) and
scale-out again; every worker it stopped exited 0; and it ends at zero replicas.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from app.settings import Settings
from broker.celery_app import priority_lists, queue_name
from broker.connection import redis_client
from tests.faults.web_clients import CHAT, Stream, start_stream, words
from tests.stack import Proc, child_env, full_stack, isolated_settings, wait_for

pytestmark = pytest.mark.faults
logger = logging.getLogger(__name__)

BURST = 16
RATE = 20.0  # echo tokens per second: each reply streams for ~4 s
TARGET = 4  # queue length per replica (the ScaledObject's target)
MAX_REPLICAS = 2
COOLDOWN_S = 2.0  # the queue empty this long: scale in by one
TICK_S = 0.2


def queue_length(client: object, model: str) -> int:
    """What the ScaledObject's triggers read, combined as its formula combines them:
    the interactive lists, and the batch lists at a quarter of their weight."""
    pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
    interactive = priority_lists(queue_name("interactive", model))
    batch = priority_lists(queue_name("batch", model))
    for key in interactive + batch:
        pipe.llen(key)
    lengths = pipe.execute()
    n = len(interactive)
    return int(sum(lengths[:n]) + sum(lengths[n:]) / 4)


@dataclass
class Autoscaler:
    """KEDA and the HPA for one model's worker Deployment, in a thread."""

    settings: Settings
    log_dir: Path
    open_streams: Callable[[], int]
    replicas: list[Proc] = field(default_factory=list)
    stopped: list[tuple[Proc, int]] = field(default_factory=list)  # and streams open then
    started: int = 0
    peak: int = 0
    _quit: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        client = redis_client(self.settings.redis_url, max_connections=2)
        model = self.settings.served_name
        empty_since = time.monotonic()
        try:
            while not self._quit.wait(TICK_S):
                length = queue_length(client, model)
                now = time.monotonic()
                if length > 0:
                    empty_since = now
                    wanted = min(MAX_REPLICAS, math.ceil(length / TARGET))
                    while len(self.replicas) < wanted:
                        self._scale_out(length)
                elif self.replicas and now - empty_since >= COOLDOWN_S:
                    self._scale_in()
                    empty_since = now
        finally:
            client.connection_pool.disconnect()

    def _scale_out(self, length: int) -> None:
        self.started += 1
        name = f"worker-{self.started}"
        proc = Proc(
            [sys.executable, "-m", "workers", "--loglevel", "INFO"],
            child_env(self.settings),
            self.log_dir / f"{name}-{uuid.uuid4().hex[:4]}.log",
        )
        self.replicas.append(proc)
        self.peak = max(self.peak, len(self.replicas))
        logger.warning("queue %d: scaled out to %d (%s)", length, len(self.replicas), name)

    def _scale_in(self) -> None:
        proc = self.replicas.pop()  # the newest, as a Deployment scales in by default
        open_now = self.open_streams()
        proc.popen.send_signal(signal.SIGTERM)
        self.stopped.append((proc, open_now))
        left = len(self.replicas)
        logger.warning("queue empty: scaled in to %d; streams open: %d", left, open_now)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="autoscaler", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._quit.set()
        for proc in self.replicas + [p for p, _ in self.stopped]:
            proc.stop()


@pytest.mark.timeout(240)
def test_a_burst_against_zero_replicas_scales_out_and_in_without_loss(
    models_dir: Path, tmp_path: Path
) -> None:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=RATE,
        worker_slots=8,  # 16 streams need both replicas
        model_wait_s=60.0,
        drain_s=1.0,
        lease_ttl_s=4.0,
        web_workers=1,
        web_threads=32,
    )
    with full_stack(settings, tmp_path / "logs", workers=()) as stack:
        streams = [Stream(CHAT, words(f"burst {i} 🦊", 36)) for i in range(BURST)]
        scaler = Autoscaler(
            stack.settings,
            stack.log_dir,
            open_streams=lambda: sum(1 for s in streams if not s.ended.is_set()),
        )
        stack.callback(scaler.stop)
        scaler_thread = scaler.start()
        threads = [start_stream(stack.base_url, stack.settings.served_name, s) for s in streams]
        for t in threads:
            t.join(180)
        outcomes = [s.describe() for s in streams if s.outcome() != "exact"]
        assert not outcomes, "\n".join(outcomes) + "\n" + stack.logs()
        assert all(s.status == 200 for s in streams)
        # Down to zero replicas once the queue stays empty; every stopped worker drained.
        wait_for(lambda: not scaler.replicas, 30, "scale-in to zero replicas")
        scaler._quit.set()
        scaler_thread.join(5)
        for proc, _open in scaler.stopped:
            assert proc.popen.wait(30) == 0, proc.output()
    in_streams = [n for _, n in scaler.stopped if n > 0]
    logger.warning(
        "started %d workers (peak %d); stopped %d, %d of them with streams open",
        scaler.started,
        scaler.peak,
        len(scaler.stopped),
        len(in_streams),
    )
    assert scaler.peak == MAX_REPLICAS
    assert in_streams, "no scale-in happened while streams were open"
