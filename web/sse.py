"""Server-sent events framing, as OpenAI clients parse it.

Each event is one ``data: <json>`` line and a blank line; the stream ends with
``data: [DONE]``. Comment lines (``: keep-alive``) keep idle connections open through
proxies and make a vanished client visible (the write fails). Errors after the
response started cannot change the status any more, so they travel as a
``data: {"error": {...}}`` event, which the openai SDK raises as ``APIError``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

from flask import Response

from app.errors import error_body
from broker import drive
from broker.backbone import client_error
from broker.run import Item, Run

logger = logging.getLogger(__name__)

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


def event_stream(
    run: Run,
    first: list[Item],
    keepalive_s: float,
    *,
    opening: Callable[[], str],
    frames: Callable[[list[Item]], str],
    done: Callable[[], bool],
    ping: str = KEEPALIVE,
    error: Callable[[BaseException], str] = error_frame,
) -> Response:
    """The SSE response of an API whose events name themselves and carry their resume
    ids (Anthropic's Messages, OpenAI's Responses): ``opening()``, then ``frames`` of
    each read (``drive.reads``, after ``first``) until ``done()``. A hand-over ends it
    with ``HANDED_OVER`` (the client resumes with Last-Event-ID), any other failure
    with ``error``'s event, so every stream ends with a final event or an error event.
    Chat completions have a loop of their own (``web.openai_routes``): they write
    through the hub's pump and end with ``[DONE]``."""

    def body() -> Iterator[str]:
        try:
            head = opening()
            if head:
                yield head
            for read in drive.reads(run, keepalive_s, first):
                if read is None:
                    yield ping
                    continue
                text = frames(read)
                if text:
                    yield text
                if done():
                    break
        except drive.HandedOver:  # resumed on another process (Last-Event-ID)
            yield HANDED_OVER
        except Exception as exc:
            logger.exception("stream of request %s failed", run.request_id)
            run.close(error=exc)
            yield error(client_error(exc))

    response = Response(body(), mimetype=MIMETYPE, headers=HEADERS)
    response.call_on_close(lambda: run.close(disconnected=not run.ended, resumable=True))
    return response
