"""SSE event ids and ``Last-Event-ID``: the client-side half of resumable streams.

Each SSE event carries the run's event cursor (``<output chunk ordinal>/<index>``, see
``broker.run``) as its ``id:``. A client that lost its connection sends the last id it
saw back, and ``Runner.resume`` continues right after that event.
"""

from __future__ import annotations

import re

from app.errors import InvalidRequest
from broker.run import Item

_CURSOR = re.compile(r"[0-9]{1,18}/[0-9]{1,6}")


def event_id(item: Item) -> str:
    return item[0]


def parse_event_id(raw: str | None) -> str | None:
    """The cursor a client sent back (None: from the start); 400 when malformed."""
    if raw is None or not raw.strip():
        return None
    value = raw.strip()
    if not _CURSOR.fullmatch(value):
        raise InvalidRequest(
            "Last-Event-ID must be an event id this server sent (like '17/3').",
            param="Last-Event-ID",
            code="invalid_event_id",
        )
    return value
