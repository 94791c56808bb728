"""What a Celery task thread hands the engine thread, and waits on.

A task claims its request, builds a ``WorkItem`` (the request's engine jobs and how to
publish them: ``workers.runtime.WorkerRuntime.work_item``), submits it to the engine
thread and blocks on the ``JobHandle`` until the request ends there; the handle's
``result`` is what the task returns (``broker.celery_app.GenerateResult``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from broker.celery_app import GenerateResult
from workers.engines.base import EngineJob


@dataclass(slots=True)
class WorkItem:
    """One request (attempt) to generate: its engine jobs and how to publish them."""

    request_id: str
    attempt: int
    lease_value: str
    jobs: list[EngineJob]
    deadline: float  # unix time
    ordinal: int = 0  # the request's last chunk before this attempt (broker/chunks.py)


@dataclass
class JobHandle:
    """What a task thread waits on; ``result`` is set when the request ended here."""

    item: WorkItem
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerateResult | None = None

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)
