"""The WebSocket chat at ``/v1/ws`` and the browser chat page at ``/``.

One socket carries many chat requests at once, each tagged with an id the client
chooses; the protocol is documented for client writers in ``docs/websocket.md`` and its
messages are ``web.ws_messages`` (pure). This module is the I/O and decides nothing
about requests: ``ChatSocket`` reads messages on the connection's own thread, runs one
reader thread per request that follows its ``Run`` (``broker.drive.follow``), and
serializes every write with a lock because wsproto's connection state is not
thread-safe. A ``cancel`` message cancels at once; a socket that closes leaves its
requests running for ``resume_grace_s`` so the client can resume them, then they are
cancelled. Browsers' origins are checked here too (``origin_allowed``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, Flask, Request, Response, current_app, request
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from app import logs
from app.errors import (
    AuthenticationFailed,
    InvalidRequest,
    KeyRevoked,
    OriginNotAllowed,
    QuotaExceeded,
    TokenRelayError,
)
from app.intake import Endpoint
from app.settings import Settings
from broker import drive
from broker.backbone import client_error
from broker.response_service import ResponseService, StartedResponse
from broker.run import Run
from broker.runner import Runner
from web.auth import Tenant, authenticate, bearer_key, exempt
from web.bodies import client_trace
from web.context import connections_of, responses_of, runner_of, settings_of
from web.ws_messages import (
    CancelChat,
    ChatStart,
    Ping,
    RejectedMessage,
    ResponseStart,
    ResumeChat,
    done_message,
    error_message,
    parse_client_message,
    server_message,
)

logger = logging.getLogger(__name__)

WS_PATH = "/v1/ws"
# How often a blocked reader wakes to notice a closed socket.
READ_BLOCK_S = 1.0
# Close code for a refused connection (RFC 6455 "policy violation").
CLOSE_POLICY_VIOLATION = 1008
# Close code when this process stops and hands its sockets over (RFC 6455 / IANA
# "service restart"): the client reconnects and sends ``resume`` with its cursor.
CLOSE_SERVICE_RESTART = 1012


# ---------------------------------------------------------------------------------------
# Authentication
# ---------------------------------------------------------------------------------------


_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _origin_parts(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an ``Origin`` value (None: not a usable origin)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if not scheme or not host:
        return None
    return scheme, host, port if port is not None else _DEFAULT_PORTS.get(scheme, -1)


def origin_allowed(origin: str | None, host: str | None, allowed: list[str]) -> bool:
    """Whether a WebSocket upgrade from ``origin`` may proceed.

    Browsers send ``Origin`` on every WebSocket upgrade and let any page open one to any
    address, so without this check a page the user visits could drive a server on their
    loopback (no keys is the default). Non-browser clients send no Origin: allowed (they
    are not acting for a page). Same origin means the Origin's host and port are the
    ``Host`` the request was addressed to; ``allowed`` adds exact origins, or ``*``.
    """
    if origin is None:
        return True
    if "*" in allowed:
        return True
    parts = _origin_parts(origin)
    if parts is None:  # "null" (sandboxed frames, file://) or garbage
        return False
    if any(_origin_parts(a) == parts for a in allowed):
        return True
    if not host:
        return False
    scheme, o_host, o_port = parts
    try:
        target = urlsplit(f"//{host.strip()}")
        h_host, h_port = (target.hostname or "").lower(), target.port
    except ValueError:
        return False
    return o_host == h_host and o_port == (h_port or _DEFAULT_PORTS.get(scheme, -1))


def presented_key(req: Request) -> str | None:
    """The API key of an upgrade request: ``Authorization: Bearer`` wins; browsers,
    which cannot set headers on a WebSocket, may pass ``?api_key=`` instead."""
    return bearer_key(req.headers.get("Authorization")) or req.args.get("api_key") or None


# ---------------------------------------------------------------------------------------
# The socket (I/O)
# ---------------------------------------------------------------------------------------


class ChatSocket:
    """One client connection: reads messages, runs its requests, writes their output."""

    def __init__(
        self,
        ws: Any,
        runner: Runner,
        responses: ResponseService,
        settings: Settings,
        tenant: Tenant | None = None,
        trace: dict[str, str] | None = None,
    ) -> None:
        self.ws = ws
        # The handshake's trace context: the parent of every request on the socket.
        self.trace = trace
        self.runner = runner
        self.responses = responses
        self.settings = settings
        # Whose requests these are: only they may resume them (web.auth).
        self.tenant = tenant or Tenant(owner="", sees_all=True)
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._running: dict[str, Run] = {}
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
        """Handle messages until the client goes; its runs' readers then close them."""
        try:
            while not self._closed.is_set():
                if self.runner.closing.is_set():  # drained: resume on another process
                    self.ws.close(reason=CLOSE_SERVICE_RESTART, message="server stopping")
                    break
                if self.runner.key_revoked(self.tenant.owner):
                    _refuse(self.ws, KeyRevoked(), "api key revoked")
                    break
                raw = self.ws.receive(timeout=READ_BLOCK_S)
                if raw is not None:
                    self.handle(raw)
        except ConnectionClosed:
            pass
        finally:
            self._closed.set()

    def handle(self, raw: str | bytes) -> None:
        """Answer one message; nothing a client sends can end the connection here."""
        try:
            msg = parse_client_message(raw, max_bytes=self.settings.ws_max_message_bytes)
        except RejectedMessage as rej:
            self.send(error_message(rej.error, rej.id))
            if rej.id is not None and rej.final:
                self.send(done_message(rej.id))
            return
        except Exception as exc:  # a bug reading one message: answer it, keep the socket
            logger.exception("reading a WebSocket message failed")
            self.send(error_message(client_error(exc)))
            return
        if isinstance(msg, Ping):
            self.send({"type": "pong", "id": msg.id} if msg.id else {"type": "pong"})
        elif isinstance(msg, CancelChat):
            self.cancel(msg.id)
        else:
            self.start(msg)

    def start(self, msg: ChatStart | ResponseStart | ResumeChat) -> None:
        with self._state_lock:
            duplicate = msg.id in self._running
        if duplicate:
            rej = InvalidRequest(
                f"A request with id {msg.id!r} is still running on this socket.",
                param="id",
                code="duplicate_id",
            )
            self.send(error_message(rej, msg.id))
            return
        started: StartedResponse | None = None
        try:
            if isinstance(msg, ResponseStart):
                started = self.responses.start(
                    msg.body, self.tenant, route=WS_PATH, stream=True, trace=self.trace
                )
                assert started.run is not None  # streamed: always watched
                run = started.run
            elif isinstance(msg, ChatStart):
                run = self.runner.start(
                    Endpoint.CHAT, msg.body, route=WS_PATH, stream=True,
                    owner=self.tenant.owner, trace=self.trace,
                )  # fmt: skip
            else:
                run = self.runner.resume(
                    msg.request_id, msg.cursor, route=WS_PATH, scope=self.tenant.owner,
                    trace=self.trace,
                )  # fmt: skip
        except Exception as exc:
            if not (isinstance(exc, TokenRelayError) and exc.public):
                logger.exception("WebSocket chat request %r failed to start", msg.id)
            self.send(error_message(client_error(exc), msg.id))
            self.send(done_message(msg.id))
            return
        with self._state_lock:
            self._running[msg.id] = run
        started_msg = {"type": "started", "id": msg.id, "request_id": run.request_id}
        if started is not None:
            started_msg["response_id"] = started.stored.response_id
        self.send(started_msg)
        read = self._reader(msg.id, run, started)
        threading.Thread(
            target=self._relay,
            args=(msg.id, run, read),
            name=f"ws-reader-{run.request_id[:8]}",
            daemon=True,
        ).start()

    def cancel(self, id: str) -> None:
        """Cancel request ``id`` now; its stream still ends with finals (``abort``),
        usage and ``done``. An id that is not running is ignored: a cancel racing the
        end of its request is normal."""
        with self._state_lock:
            run = self._running.get(id)
        if run is not None:
            try:
                self.runner.cancel(run.request_id)
            except Exception:
                logger.exception("cancelling request %s failed", run.request_id)

    # -- one request's output ---------------------------------------------------------------
    def _reader(self, id: str, run: Run, started: StartedResponse | None) -> Callable[[], object]:
        """What relays one run to the socket until its end or the socket's: a chat's
        output items as ``server_message``s (with cursors), or a Responses API run's
        typed events, each in a ``response_event``."""
        if started is not None:
            return lambda: self.responses.relay(
                started,
                lambda ev: self.send({"type": "response_event", "id": id, "event": ev}),
                self._closed.is_set,
                READ_BLOCK_S,
            )
        return lambda: drive.follow(
            run,
            lambda item: self.send(server_message(id, item[1], item[0])),
            lambda: run.ended,
            stopped=self._closed.is_set,
            tick_s=READ_BLOCK_S,
        )

    def _relay(self, id: str, run: Run, read: Callable[[], object]) -> None:
        """Run ``read`` on this request's thread; whatever happens, close the run once,
        free the id and end with ``done``."""
        error: BaseException | None = None
        try:
            read()
        except Exception as exc:
            logger.exception("relaying request %s to a WebSocket failed", run.request_id)
            error = exc
            self.send(error_message(client_error(exc), id))
        finally:
            run.close(disconnected=self._closed.is_set(), resumable=True, error=error)
            with self._state_lock:
                self._running.pop(id, None)
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
    @sock.route(WS_PATH)  # type: ignore[untyped-decorator]
    @exempt
    def chat_socket(ws: Any) -> None:
        settings = settings_of(current_app)
        origin = request.headers.get("Origin")
        if not origin_allowed(origin, request.host, settings.ws_allowed_origins):
            logger.warning("WebSocket from origin %r refused (host %r)", origin, request.host)
            forbidden = OriginNotAllowed(
                f"WebSocket connections from origin {origin!r} are not allowed; add it to "
                "TOKENRELAY_WS_ALLOWED_ORIGINS to allow it."
            )
            _refuse(ws, forbidden, "origin not allowed")
            return
        try:
            tenant = authenticate(
                settings, presented_key(request), runner_of(current_app).policy.cache
            )
        except AuthenticationFailed:
            _refuse(ws, AuthenticationFailed("Invalid or missing API key."), "invalid api key")
            return
        logs.bind(key_id=logs.key_label(tenant.owner))  # this socket's log lines
        try:
            close = connections_of(current_app).open(tenant.owner)
        except QuotaExceeded as exc:
            _refuse(ws, exc, "key_max_connections")
            return
        try:
            ChatSocket(
                ws, runner_of(current_app), responses_of(current_app), settings, tenant,
                client_trace(request),
            ).serve()  # fmt: skip
        finally:
            close()


def _refuse(ws: Any, error: TokenRelayError, reason: str) -> None:
    """Tell a refused client why (an error message), then close with 1008."""
    try:
        ws.send(json.dumps(error_message(error)))
        ws.close(reason=CLOSE_POLICY_VIOLATION, message=reason)
    except ConnectionClosed:
        pass
