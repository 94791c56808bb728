"""The WebSocket chat at ``/v1/ws`` and the browser chat page at ``/``.

One socket carries many chat requests at once, each tagged with an id the client
chooses; the protocol is documented for client writers in ``docs/websocket.md``.

The module has a pure half and a thin I/O half, so the protocol can be tested without a
socket:

- ``parse_client_message`` turns one received message into a ``ChatStart``,
  ``CancelChat`` or ``Ping``, or raises ``RejectedMessage`` carrying the OpenAI error to
  answer with (and the id, when the message had a usable one).
- ``server_message`` turns one output-stream event into the message a client gets.
- ``ChatSocket`` is the I/O: it reads messages on the connection's own thread (under
  gunicorn's gthread workers that is one pool thread per socket), runs one reader thread
  per request that follows its output stream, and serializes every write with a lock
  because wsproto's connection state is not thread-safe. A cancel message, or the
  socket closing for any reason, cancels generation upstream.

Requests go through ``GenerationService`` exactly as HTTP requests do (same validation,
templating, admission and output stream), so the text a WebSocket client receives is the
text an SSE or non-streaming client receives for the same request.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Flask, Request, Response, current_app, request
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from app.errors import (
    AuthenticationFailed,
    InvalidRequest,
    NotImplementedFeature,
    PayloadTooLarge,
    TokenRelayError,
    error_body,
)
from app.fold import usage_from_event
from app.messages import OutputEvent, OutputKind
from app.protocol import (
    ChatCompletionRequest,
    parse_chat_request,
)
from app.response_models import (
    ChatChoiceLogprobs,
)
from app.settings import Settings
from broker.streams import is_terminal
from web.app import service_of, settings_of
from web.auth import bearer_key, exempt, key_ok
from web.bodies import loads_repaired
from web.errors import PipelineError
from web.metrics import RequestTimer, WebMetrics, metrics_of
from web.service import GenerationService, Submitted

logger = logging.getLogger(__name__)

WS_PATH = "/v1/ws"
MAX_ID_LENGTH = 256
# A request's reader gives up this long after the request's own deadline: the streamer
# ends a late request with a 504 itself, so this only matters when no streamer is left.
READER_GRACE_S = 30.0
# How often a blocked reader wakes to notice a closed socket (the close itself already
# cancelled generation, so this bounds only how long the thread lingers).
READ_BLOCK_MS = 1000
# Close code for a refused connection (RFC 6455 "policy violation").
CLOSE_POLICY_VIOLATION = 1008


# ---------------------------------------------------------------------------------------
# Client -> server messages (pure)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatStart:
    """``{"type": "chat", "id": ..., <chat-completions body>}``, validated."""

    id: str
    request: ChatCompletionRequest


@dataclass(frozen=True, slots=True)
class CancelChat:
    """``{"type": "cancel", "id": ...}``."""

    id: str


@dataclass(frozen=True, slots=True)
class Ping:
    """``{"type": "ping"}``; answered with a pong echoing the optional id."""

    id: str | None = None


ClientMessage = ChatStart | CancelChat | Ping


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


def parse_client_message(
    raw: str | bytes,
    *,
    max_bytes: int,
    max_stop_sequences: int,
    max_n: int,
) -> ClientMessage:
    """Decode and validate one received message.

    Chat bodies go through ``parse_chat_request`` (the HTTP route's validation, with the
    same limits), so the error a client gets names the offending field in ``param``.
    """
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    too_large = (
        PayloadTooLarge(f"Message of {size} bytes is over the limit of {max_bytes} bytes.")
        if size > max_bytes
        else None
    )
    try:
        # Repaired as HTTP bodies are: broken UTF-8 and raw control characters are kept.
        body = loads_repaired(raw)
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
        # Still parsed (it is under the hard limit) so the client learns which request
        # failed, and a chat gets its done like any other rejected request.
        raise RejectedMessage(too_large, msg_id, final=kind == "chat")
    if kind == "ping":
        return Ping(msg_id)
    if kind not in ("chat", "cancel"):
        raise RejectedMessage(
            InvalidRequest(
                f"Unknown message type {kind!r}; expected 'chat', 'cancel' or 'ping'.",
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

    # The socket always streams; stream_options is accepted as it is on a streaming POST.
    body["stream"] = True
    try:
        req = parse_chat_request(body, max_stop_sequences=max_stop_sequences, max_n=max_n)
    except InvalidRequest as exc:
        raise RejectedMessage(exc, msg_id) from None
    if req.uses_deprecated_functions:
        raise RejectedMessage(
            NotImplementedFeature(
                "The deprecated 'functions' / 'function_call' API is not supported.",
                param="functions",
            ),
            msg_id,
        )
    return ChatStart(msg_id, req)


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
    _, body = error_body(PipelineError(message or "", status))
    error: dict[str, Any] = body["error"]
    return error


def server_message(id: str, event: OutputEvent) -> dict[str, Any]:
    """The message a client receives for one output-stream event of request ``id``."""
    if event.kind is OutputKind.DELTA:
        out: dict[str, Any] = {"type": "delta", "id": id, "choice": event.choice}
        out["text"] = event.text
        if event.logprobs is not None:
            out["logprobs"] = ChatChoiceLogprobs.from_entries(event.logprobs).to_dict()
        return out
    if event.kind is OutputKind.FINAL:
        out = {
            "type": "final",
            "id": id,
            "choice": event.choice,
            "finish_reason": event.finish_reason.value if event.finish_reason else None,
            "stop_reason": event.stop_reason,
        }
        if event.error is not None:
            out["error"] = stream_error_body(event.error, event.code)
        return out
    if event.kind is OutputKind.USAGE:
        usage = usage_from_event(event.usage)  # without the streamer's internal keys
        return {"type": "usage", "id": id, "usage": usage.to_dict()}
    return {"type": "error", "id": id, "error": stream_error_body(event.error, event.code)}


def done_message(id: str) -> dict[str, Any]:
    return {"type": "done", "id": id}


# ---------------------------------------------------------------------------------------
# Authentication
# ---------------------------------------------------------------------------------------


def presented_key(req: Request) -> str | None:
    """The API key of an upgrade request: ``Authorization: Bearer`` wins; browsers,
    which cannot set headers on a WebSocket, may pass ``?api_key=`` instead."""
    return bearer_key(req.headers.get("Authorization")) or req.args.get("api_key") or None


# ---------------------------------------------------------------------------------------
# The socket (I/O)
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Running:
    submitted: Submitted
    timer: RequestTimer | None


class ChatSocket:
    """One client connection: reads messages, runs its requests, writes their output.

    ``metrics`` (optional) records each request as the HTTP routes do, under the
    endpoint label ``/v1/ws``; ``tokenrelay_requests`` counts each chat request with
    the HTTP status its outcome would have had.
    """

    def __init__(
        self,
        ws: Any,
        service: GenerationService,
        settings: Settings,
        *,
        metrics: WebMetrics | None = None,
    ) -> None:
        self.ws = ws
        self.service = service
        self.settings = settings
        self.metrics = metrics
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        self._closed = threading.Event()

    # -- writing ----------------------------------------------------------------------------
    def send(self, message: Mapping[str, Any]) -> bool:
        """Write one message; False once the socket is gone (the caller stops)."""
        data = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
        with self._send_lock:
            if self._closed.is_set():
                return False
            try:
                self.ws.send(data)
            except (ConnectionClosed, OSError):
                self._closed.set()
                return False
        return True

    # -- reading ----------------------------------------------------------------------------
    def serve(self) -> None:
        """Handle messages until the client goes; then cancel what is still running."""
        try:
            while not self._closed.is_set():
                raw = self.ws.receive(timeout=READ_BLOCK_MS / 1000)
                if raw is not None:
                    self.handle(raw)
        except ConnectionClosed:
            pass
        finally:
            self._closed.set()
            with self._state_lock:
                orphans = [r.submitted.request_id for r in self._running.values()]
            for rid in orphans:
                self._cancel_quietly(rid)

    def handle(self, raw: str | bytes) -> None:
        """Answer one message; nothing a client sends can end the connection here."""
        try:
            msg = parse_client_message(
                raw,
                max_bytes=self.settings.ws_max_message_bytes,
                max_stop_sequences=self.settings.max_stop_sequences,
                max_n=self.settings.max_n,
            )
        except RejectedMessage as rej:
            self.send(error_message(rej.error, rej.id))
            if rej.id is not None and rej.final:
                self._count(rej.error)
                self.send(done_message(rej.id))
            return
        if isinstance(msg, Ping):
            self.send({"type": "pong", "id": msg.id} if msg.id else {"type": "pong"})
        elif isinstance(msg, CancelChat):
            self.cancel(msg.id)
        else:
            self.start(msg)

    def start(self, msg: ChatStart) -> None:
        with self._state_lock:
            duplicate = msg.id in self._running
        if duplicate:
            rej = InvalidRequest(
                f"A request with id {msg.id!r} is still running on this socket.",
                param="id",
                code="duplicate_id",
            )
            self._count(rej)
            self.send(error_message(rej, msg.id))
            return
        try:
            submitted = self.service.submit(self.service.chat_record(msg.request))
        except Exception as exc:
            if not (isinstance(exc, TokenRelayError) and exc.public):
                logger.exception("WebSocket chat request %r failed to start", msg.id)
            self._count(exc)
            self.send(error_message(exc, msg.id))
            self.send(done_message(msg.id))
            return
        timer = None
        if self.metrics is not None:
            timer = RequestTimer(self.metrics, WS_PATH, submitted.record.num_choices)
            timer.begin()
        running = _Running(submitted, timer)
        with self._state_lock:
            self._running[msg.id] = running
        threading.Thread(
            target=self._follow,
            args=(msg.id, running),
            name=f"ws-reader-{submitted.request_id[:8]}",
            daemon=True,
        ).start()

    def _count(self, outcome: BaseException | None) -> None:
        """Count one chat request by the HTTP status its outcome maps to."""
        if self.metrics is None:
            return
        status, error_type = 200, ""
        if outcome is not None:
            status, body = error_body(outcome)
            error_type = body["error"]["type"]
        self.metrics.requests.labels(WS_PATH, str(status), error_type).inc()

    def cancel(self, id: str) -> None:
        """Cancel request ``id``; its stream still ends with finals (``abort``), usage
        and ``done``. An id that is not running is ignored: a cancel racing the end of
        its request is normal."""
        with self._state_lock:
            running = self._running.get(id)
        if running is not None:
            self._cancel_quietly(running.submitted.request_id)

    def _cancel_quietly(self, rid: str) -> None:
        try:
            self.service.cancel(rid)
        except Exception:
            logger.exception("cancelling request %s failed", rid)

    # -- one request's output ---------------------------------------------------------------
    def _follow(self, id: str, running: _Running) -> None:
        """Relay request ``id``'s output stream to the socket until its terminal event."""
        submitted, timer = running.submitted, running.timer
        rid = submitted.request_id
        give_up_at = submitted.record.deadline + READER_GRACE_S
        complete = False
        failure: BaseException | None = None
        usage: dict[str, Any] | None = None
        try:
            for item in self.service.events(rid, block_ms=READ_BLOCK_MS):
                if self._closed.is_set():
                    break
                if item is None:
                    if time.time() > give_up_at:
                        failure = PipelineError("The request timed out waiting for output.", 504)
                        self.send(error_message(failure, id))
                        break
                    continue
                _, event = item
                if not self.send(server_message(id, event)):
                    break
                if event.kind is OutputKind.DELTA and event.text and timer is not None:
                    timer.text_sent()
                elif event.kind is OutputKind.USAGE:
                    usage = event.usage
                elif event.kind is OutputKind.ERROR:
                    failure = PipelineError(event.error or "", event.code)
                complete = is_terminal(event)
        except Exception as exc:
            logger.exception("relaying request %s to a WebSocket failed", rid)
            failure = exc
            self.send(error_message(exc, id))
        finally:
            if complete:
                self.service.finish(rid)
            else:
                self._cancel_quietly(rid)
            with self._state_lock:
                self._running.pop(id, None)
            if timer is not None:
                timer.end(usage, disconnected=self._closed.is_set() and not complete)
            self._count(failure)
            # After the id is free again, so a client may reuse it as soon as it sees done.
            self.send(done_message(id))


# ---------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------

page = Blueprint("chat_page", __name__)


@page.get("/")
def chat_page() -> Response:
    """The browser chat page (static files, no build step)."""
    return current_app.send_static_file("index.html")


def register(sock: Sock) -> None:
    """Add ``/v1/ws`` and the chat page at ``/`` to the app ``sock`` was created with."""
    app: Flask | None = sock.app
    if app is None:  # pragma: no cover - create_app always passes Sock(app)
        raise RuntimeError("register() needs a Sock bound to an app")
    settings = settings_of(app)
    app.config.setdefault(
        "SOCK_SERVER_OPTIONS",
        {
            "ping_interval": settings.ws_ping_interval_s or None,
            # simple-websocket closes the socket (1009) past this; messages between
            # ws_max_message_bytes and this get an error and the socket stays open.
            "max_message_size": max(settings.max_body_bytes, settings.ws_max_message_bytes),
        },
    )
    app.register_blueprint(page)

    # exempt: the app-wide Bearer check would refuse a browser's ?api_key= before the
    # upgrade, where the page cannot see why; this view checks the key itself.
    @sock.route(WS_PATH)
    @exempt
    def chat_socket(ws: Any) -> None:
        settings = settings_of(current_app)
        if not key_ok(settings.api_keys, presented_key(request)):
            refused = AuthenticationFailed("Invalid or missing API key.")
            try:
                ws.send(json.dumps(error_message(refused)))
                ws.close(reason=CLOSE_POLICY_VIOLATION, message="invalid api key")
            except ConnectionClosed:
                pass
            return
        ChatSocket(ws, service_of(current_app), settings, metrics=metrics_of(current_app)).serve()
