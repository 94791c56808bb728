"""SSE event ids and ``Last-Event-ID``: the client-side half of resumable streams.

Each SSE event carries the run's event cursor (``<output chunk ordinal>/<index>``, see
``broker.run``) as its ``id:``. A client that lost its connection sends the last id it
saw back, and ``Runner.resume`` continues right after that event. Anthropic's Messages
stream makes several events of one output event (a block's stop, the message's delta
and stop): each gets the cursor and its place among them (``<cursor>/<k>``), so that
every event's id is its own (``web.messages_api``).
"""

from __future__ import annotations

import re

from broker.run import Item, invalid_event_id

_CURSOR = re.compile(r"[0-9]{1,18}/[0-9]{1,6}")
_MESSAGE_EVENT = re.compile(r"[0-9]{1,18}/[0-9]{1,6}(/[0-9]{1,6})?")


def event_id(item: Item) -> str:
    return item[0]


def parse_event_id(raw: str | None, *, message_events: bool = False) -> str | None:
    """The cursor a client sent back (None: from the start); 400 when malformed.
    ``message_events``: a Messages stream's event id (``<cursor>/<k>``) is one too."""
    if raw is None or not raw.strip():
        return None
    value = raw.strip()
    if not (_MESSAGE_EVENT if message_events else _CURSOR).fullmatch(value):
        raise invalid_event_id()
    return value
