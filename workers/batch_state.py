"""A batch as its driver holds it (``workers.batcher.BatchDriver``): its lines, the runs
of those submitted, how it ends; and the ids derived from it, deterministic so that a
driver that takes a batch over finds what the one before it sent and wrote.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import deque
from dataclasses import dataclass, field

from app.batches import PlannedLine
from app.fold import ResponseFold
from app.intake import PreparedRequest
from app.responses_events import ResponsesFold
from broker.batches import BatchBody, BatchStore
from broker.files import FileStore
from broker.run import Run

logger = logging.getLogger(__name__)


class WakingEvent(threading.Event):
    """The stop flag: setting it also sets ``wakes`` (what the loop sleeps on), so a
    stop does not wait for the loop's sleep to run out."""

    def __init__(self, wakes: threading.Event) -> None:
        super().__init__()
        self._wakes = wakes

    def set(self) -> None:
        super().set()
        self._wakes.set()


def line_request_id(batch_id: str, index: int) -> str:
    """Line ``index``'s request id: deterministic, so a takeover finds what was sent."""
    return f"{batch_id}-{index}"


def result_file_id(batch_id: str, kind: str) -> str:
    """Output/error file ids derived from the batch, so writing them twice is harmless."""
    digest: str = hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()
    return "file-" + digest[:24]


def write_result_files(
    batches: BatchStore, files: FileStore, batch_id: str, now: float
) -> dict[str, str | int]:
    """Write a finished batch's output and error files (ids derived from the batch:
    writing them twice is harmless); the batch's fields naming them."""
    output: list[str] = []
    errors: list[str] = []
    for _index, line in batches.results(batch_id):
        (output if line.ok else errors).append(line.to_line() + "\n")
    fields: dict[str, str | int] = {}
    owner = batches.owner(batch_id)  # the results belong to whoever made the batch
    for kind, lines in (("output", output), ("error", errors)):
        if lines:
            f = files.create(
                filename=f"{batch_id}_{kind}.jsonl",
                purpose="batch_output",
                content="".join(lines).encode(),
                now=now,
                file_id=result_file_id(batch_id, kind),
                owner=owner,
                enforce_quota=False,  # counted, never refused: the batch is done
            )
            fields[f"{kind}_file_id"] = f.id
    logger.info("batch %s: %d output lines, %d error lines", batch_id, len(output), len(errors))
    return fields


@dataclass(slots=True)
class LineRun:
    """A line whose request was submitted: its run's events are being folded."""

    index: int
    custom_id: str
    run: Run
    fold: ResponseFold | ResponsesFold

    @property
    def request_id(self) -> str:
        return self.run.request_id


@dataclass
class DrivenBatch:
    """A batch this driver holds the lock of."""

    body: BatchBody
    custom_ids: dict[int, str] = field(default_factory=dict)  # valid lines
    pending: deque[PlannedLine[PreparedRequest]] = field(default_factory=deque)
    running: dict[str, LineRun] = field(default_factory=dict)  # by request id
    ending: str | None = None  # "batch_cancelled" / "batch_expired" while winding down
    total: int = 0  # the input file's lines, once planned
    wind_down_since: float = 0.0

    @property
    def id(self) -> str:
        return self.body.id


class LockLost(Exception):
    """Another driver holds the batch now: stop driving it, touch nothing of it."""
