"""The WebSocket chat's messages, pure (no socket): what a client may send, what it gets.

- ``parse_client_message`` reads one received message's envelope into a ``ChatStart``
  (its body still raw: ``Runner.start`` validates it exactly as the HTTP route does),
  ``ResponseStart``, ``ResumeChat``, ``CancelChat`` or ``Ping``, or raises
  ``RejectedMessage`` carrying the OpenAI error to answer with (and the id, when the
  message had a usable one).
- ``server_message`` turns one run item into the message a client gets; each carries
  the event ``cursor`` a client sends back in a ``resume`` message after a dropped
  socket, on any web process. ``error_message`` and ``done_message`` end a request.

The protocol is documented for client writers in ``docs/websocket.md``; the socket that
carries it is ``web.ws``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.errors import (
    InvalidRequest,
    PayloadTooLarge,
    StreamError,
    TokenRelayError,
    error_body,
)
from app.fold import usage_from_event
from app.lenient_json import loads_lenient
from app.messages import OutputEvent, OutputKind
from app.response_models import ChatChoiceLogprobs, DeltaToolCall
from app.timings import timings_from_usage
from web.resume import parse_event_id

MAX_ID_LENGTH = 256


# ---------------------------------------------------------------------------------------
# Client -> server messages (pure)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatStart:
    """``{"type": "chat", "id": ..., <chat-completions body>}``; the body is validated
    by ``Runner.start``, as an HTTP body is."""

    id: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResumeChat:
    """``{"type": "resume", "id": ..., "request_id": ..., "cursor"?: ...}``: continue a
    request started on another socket (or process) after its last seen event."""

    id: str
    request_id: str
    cursor: str | None


@dataclass(frozen=True, slots=True)
class CancelChat:
    """``{"type": "cancel", "id": ...}``."""

    id: str


@dataclass(frozen=True, slots=True)
class Ping:
    """``{"type": "ping"}``; answered with a pong echoing the optional id."""

    id: str | None = None


@dataclass(frozen=True, slots=True)
class ResponseStart:
    """``{"type": "response", "id": ..., <Responses API body>}`` (``web.responses_api``):
    answered with ``response_event`` messages, then ``done``."""

    id: str
    body: dict[str, Any]


ClientMessage = ChatStart | ResponseStart | ResumeChat | CancelChat | Ping
_KINDS = ("chat", "response", "resume", "cancel", "ping")


class RejectedMessage(Exception):
    """A message the server answers with an error; the socket stays open.

    ``id`` is the message's id when it had a usable one, so the client can tell which of
    its requests failed; ``final`` says whether a ``done`` for that id follows (it does
    not for a duplicate id: the original request's ``done`` is still to come).
    """

    def __init__(self, error: TokenRelayError, id: str | None = None, *, final: bool = True):
        super().__init__(error.message)
        self.error = error
        self.id = id
        self.final = final


def parse_client_message(raw: str | bytes, *, max_bytes: int) -> ClientMessage:
    """Read one received message's envelope (the lenient JSON reader of HTTP bodies)."""
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    too_large = (
        PayloadTooLarge(f"Message of {size} bytes is over the limit of {max_bytes} bytes.")
        if size > max_bytes
        else None
    )
    try:
        body = loads_lenient(raw)
    except InvalidRequest as exc:
        exc.code = "invalid_json"
        raise RejectedMessage(too_large or exc) from None
    if not isinstance(body, dict):
        raise RejectedMessage(
            too_large or InvalidRequest("Message must be a JSON object.", code="invalid_json")
        )
    kind = body.pop("type", None)
    msg_id = _valid_id(body.pop("id", None))
    if too_large is not None:
        # Still read (it is under the hard limit) so the client learns which request
        # failed, and a chat gets its done like any other rejected request.
        raise RejectedMessage(too_large, msg_id, final=kind in ("chat", "response", "resume"))
    if kind == "ping":
        return Ping(msg_id)
    if kind not in _KINDS:
        raise RejectedMessage(
            InvalidRequest(
                f"Unknown message type {kind!r}; expected one of {', '.join(_KINDS)}.",
                param="type",
                code="unknown_message_type",
            ),
            msg_id,
            final=False,
        )
    if msg_id is None:
        raise RejectedMessage(
            InvalidRequest(
                f"A '{kind}' message needs an 'id': a non-empty string of at most "
                f"{MAX_ID_LENGTH} characters.",
                param="id",
                code="invalid_id",
            )
        )
    if kind == "cancel":
        return CancelChat(msg_id)
    if kind == "resume":
        return _resume_message(msg_id, body)
    if kind == "response":
        return ResponseStart(msg_id, body)
    return ChatStart(msg_id, body)


def _resume_message(msg_id: str, body: dict[str, Any]) -> ResumeChat:
    rid = body.get("request_id")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_LENGTH:
        raise RejectedMessage(
            InvalidRequest(
                "A 'resume' message needs the 'request_id' its chat was started with.",
                param="request_id",
            ),
            msg_id,
        )
    cursor = body.get("cursor")
    try:
        return ResumeChat(msg_id, rid, parse_event_id(cursor if isinstance(cursor, str) else None))
    except InvalidRequest as exc:
        exc.param = "cursor"
        raise RejectedMessage(exc, msg_id) from None


def _valid_id(value: Any) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH:
        return value
    return None


# ---------------------------------------------------------------------------------------
# Server -> client messages (pure)
# ---------------------------------------------------------------------------------------


def error_message(exc: BaseException, id: str | None = None) -> dict[str, Any]:
    """``{"type": "error", "id"?, "error": {...}}`` with the OpenAI error body."""
    _, body = error_body(exc)
    out: dict[str, Any] = {"type": "error"}
    if id is not None:
        out["id"] = id
    out["error"] = body["error"]
    return out


def stream_error_body(message: str | None, status: int | None) -> dict[str, Any]:
    """The OpenAI error body for an error event of an output stream: the same body an
    HTTP client gets for it (its message is written to be shown, docs/streams.md)."""
    _, body = error_body(StreamError(message, status))
    error: dict[str, Any] = body["error"]
    return error


def server_message(id: str, event: OutputEvent, cursor: str | None = None) -> dict[str, Any]:
    """The message a client receives for one output event of request ``id``;
    ``cursor`` (the event's resume point) is added when given."""
    out: dict[str, Any]
    if event.kind is OutputKind.DELTA:
        out = {"type": "delta", "id": id, "choice": event.choice, "text": event.text}
        if event.logprobs is not None:
            out["logprobs"] = ChatChoiceLogprobs.from_entries(event.logprobs).to_dict()
        if event.reasoning:
            out["reasoning"] = event.reasoning
        if event.tool_calls:  # the SSE delta's list: index, first id/type/name, arguments
            out["tool_calls"] = [DeltaToolCall.from_fragment(f).to_dict() for f in event.tool_calls]
    elif event.kind is OutputKind.FINAL:
        out = {
            "type": "final",
            "id": id,
            "choice": event.choice,
            "finish_reason": event.finish_reason.value if event.finish_reason else None,
            "stop_reason": event.stop_reason,
        }
        if event.error is not None:
            out["error"] = stream_error_body(event.error, event.code)
    elif event.kind is OutputKind.USAGE:
        usage = usage_from_event(event.usage)  # without the streamer's internal keys
        out = {"type": "usage", "id": id, "usage": usage.to_dict()}
        timings = timings_from_usage(event.usage)
        if timings is not None:
            out["timings"] = timings.to_dict()
    else:
        out = {"type": "error", "id": id, "error": stream_error_body(event.error, event.code)}
    if cursor:
        out["cursor"] = cursor
    return out


def done_message(id: str) -> dict[str, Any]:
    return {"type": "done", "id": id}
