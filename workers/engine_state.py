"""What the engine thread keeps per request while it generates and publishes it
(``workers.engine_thread``): the request's progress, a publish whose reply is in flight,
and one whose reply never came."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.messages import TokenDelta
from broker.celery_app import TaskOutcome
from broker.chunks import ChunkLog
from broker.publish import PendingPublish, PublishItem, ShardedPublish
from workers.work_items import JobHandle


@dataclass(slots=True)
class Active:
    handle: JobHandle
    open_choices: set[int]
    started: float
    unpublished: list[TokenDelta] = field(default_factory=list)
    log: ChunkLog = field(default_factory=ChunkLog)  # chunks since the last checkpoint
    first: bool = True
    cancel_sent: bool = False
    deadline_hit: bool = False
    tokens: dict[int, int] = field(default_factory=dict)
    finishes: dict[int, str] = field(default_factory=dict)
    last_publish: float = 0.0
    last_refresh: float = 0.0  # when the last publish that extended the lease was sent
    outcome: TaskOutcome = TaskOutcome.DONE
    # Its first token's time (the end of its prefill) and the steps that gave it tokens
    # (the last such step's number in ``step``): its trace's prefill and decode.
    first_token_at: float | None = None
    steps: int = 0
    step: int = -1
    # A publish of this request's tokens whose reply never came: it may have run. Until
    # Redis says whether (``RequestStore.landed``), nothing more is published for it.
    unsure: Unsure | None = None


@dataclass(slots=True)
class Unsure:
    """A failed publish's part for one request: its call's stamp, what it carried and
    how many of the deltas now at the head of ``unpublished`` were in it."""

    stamp: str
    item: PublishItem
    deltas: int
    sent_at: float


@dataclass(slots=True)
class InFlight:
    """A publish sent whose reply is still to be read: what it carried, per request."""

    pending: PendingPublish | ShardedPublish
    items: list[tuple[Active, PublishItem, list[TokenDelta]]]
    sent_at: float
    stamp: str
