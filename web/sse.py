"""Server-sent events framing, as OpenAI clients parse it.

Each event is one ``data: <json>`` line and a blank line; the stream ends with
``data: [DONE]``. Comment lines (``: keep-alive``) keep idle connections open through
proxies and make a vanished client visible (the write fails). Errors after the
response started cannot change the status any more, so they travel as a
``data: {"error": {...}}`` event, which the openai SDK raises as ``APIError``.
"""

from __future__ import annotations

import json

from app.errors import error_body

KEEPALIVE = ": keep-alive\n\n"
# The last frame of a stream this process hands over (``broker.drive.HandedOver``): no
# final event follows; the client resumes on another process with ``Last-Event-ID``.
HANDED_OVER = ": this server is stopping; resume the stream with Last-Event-ID\n\n"
DONE = "data: [DONE]\n\n"
HEADERS = {
    "Cache-Control": "no-cache",
    # nginx and similar proxies buffer responses unless told not to.
    "X-Accel-Buffering": "no",
}
MIMETYPE = "text/event-stream"


def data_frame(payload_json: str, event_id: str | None = None) -> str:
    """One event; ``payload_json`` must be single-line JSON (json/pydantic escape
    newlines). ``event_id`` (the resume cursor) becomes its ``id:`` line."""
    if event_id:
        return f"id: {event_id}\ndata: {payload_json}\n\n"
    return f"data: {payload_json}\n\n"


def error_frame(exc: BaseException, event_id: str | None = None) -> str:
    """The error event for ``exc``: its OpenAI body (a generic one unless it is ours)."""
    _status, body = error_body(exc)
    return data_frame(json.dumps(body, ensure_ascii=False), event_id)
