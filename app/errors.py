"""tokenrelay's exception tree and its one mapping to the OpenAI error body.

    TokenRelayError                      500 internal_error (generic message only)
    ├── InvalidRequest                   400 invalid_request_error
    │   └── ContextLengthExceeded        400 (prompt + max_tokens over the context)
    ├── AuthenticationFailed             401 authentication_error
    ├── NotFound                         404 not_found_error
    ├── PayloadTooLarge                  413
    ├── UnsupportedMediaType             415
    ├── QueueFull                        429 rate_limit_error (carries Retry-After)
    ├── QuotaExceeded                    429 rate_limit_error, a per-key quota (named)
    ├── NotImplementedFeature            501
    ├── ServiceUnavailable               503 (carries Retry-After)
    ├── StreamError                      an error reported on a request's output stream,
    │                                    with the status it carries (400/500/503/504)
    └── ModelError                       model directories that cannot be read

``STATUS_TYPES`` is the one status -> OpenAI error type table; ``event_error`` the one
place that says whether an output event is an error, for every framer (SSE, JSON fold,
WebSocket, batch lines).

Library errors are translated at the edge with ``raise X from exc``; only the
messages of these classes ever reach a client.
"""

from __future__ import annotations

from typing import Any

from app.messages import FinishReason, OutputEvent, OutputKind

STATUS_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled_error",
    500: "internal_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
# What the pipeline (streamers, workers, the run's own deadline) reports on a stream.
_STREAM_STATUSES = frozenset({400, 500, 503, 504})


class TokenRelayError(Exception):
    """Base class; an unexpected one becomes a generic 500."""

    status = 500
    type = "internal_error"
    code: str | None = None
    public = False  # may its message be shown to a client?

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(TokenRelayError):
    status = 400
    type = "invalid_request_error"
    public = True


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(TokenRelayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    public = True


class KeyRevoked(AuthenticationFailed):
    """The stream's API key was revoked while it ran: the stream ends with this."""

    code = "api_key_revoked"

    def __init__(self) -> None:
        super().__init__("The API key of this request has been revoked.")


class NotFound(TokenRelayError):
    status = 404
    type = "not_found_error"
    public = True


class PayloadTooLarge(TokenRelayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"
    public = True


class RequestTimeout(TokenRelayError):
    """The client did not send its whole request in time (a slow or stalled body)."""

    status = 408
    type = "timeout_error"
    code = "request_timeout"
    public = True


class UnsupportedMediaType(TokenRelayError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"
    public = True


class QueueFull(TokenRelayError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    public = True

    def __init__(self, message: str, *, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class QuotaExceeded(TokenRelayError):
    """One API key's quota is used up; the message names the quota and its setting.
    No Retry-After: waiting does not help until the key frees what it holds."""

    status = 429
    type = "rate_limit_error"
    code = "quota_exceeded"
    public = True


class RateLimited(QueueFull):
    """One API key is over its requests or tokens per minute (OpenAI's
    ``rate_limit_exceeded``); Retry-After is when its minute's window ends."""

    code = "rate_limit_exceeded"


class NotImplementedFeature(TokenRelayError):
    status = 501
    type = "not_implemented_error"
    public = True


class ServiceUnavailable(TokenRelayError):
    status = 503
    type = "service_unavailable_error"
    public = True

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after


class MethodNotAllowed(TokenRelayError):
    """An HTTP method the route does not take."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"
    public = True


class HTTPError(TokenRelayError):
    """Any other werkzeug status, answered with a fixed message of ours."""

    public = True

    def __init__(self, status: int) -> None:
        server_side = status >= 500
        super().__init__(
            "The server had an error while processing your request."
            if server_side
            else "The request could not be processed."
        )
        self.status = status
        self.type = "internal_error" if server_side else "invalid_request_error"


class PermissionDenied(TokenRelayError):
    """The key is valid but may not do this (an admin route without an admin key)."""

    status = 403
    type = "permission_error"
    code = "permission_denied"
    public = True


class OriginNotAllowed(TokenRelayError):
    """A browser page from an origin that may not use this server's WebSocket."""

    status = 403
    type = "permission_error"
    code = "origin_not_allowed"
    public = True


class StreamError(TokenRelayError):
    """An error reported on a request's output stream (a worker rejecting the prompt,
    the streamers' watchdog giving up, a choice that failed): its status is the event's
    code and its message is the event's, which the streamer writes to be shown."""

    public = True

    def __init__(self, message: str | None, status: int | None) -> None:
        super().__init__(message or "The request failed.")
        self.status = status if status in _STREAM_STATUSES else 500
        self.type = STATUS_TYPES[self.status]


def event_error(ev: OutputEvent) -> StreamError | None:
    """The error an output event reports: a request-level error, or one choice's."""
    if ev.kind is OutputKind.ERROR or (
        ev.kind is OutputKind.FINAL and ev.finish_reason is FinishReason.ERROR
    ):
        return StreamError(ev.error, ev.code)
    return None


def retry_after_of(exc: BaseException) -> int | None:
    """Seconds a client should wait before retrying (429 and 503 answers carry it)."""
    value = getattr(exc, "retry_after", None)
    return value if isinstance(value, int) else None


class ModelError(TokenRelayError):
    """A model directory is missing or malformed (an operator's problem)."""

    public = True


def rename_param(exc: TokenRelayError, param: str | None) -> None:
    """Make ``exc`` name ``param``: an error raised on the chat body that another API's
    body was translated to names the field the client sent, in ``param`` and where its
    message quotes the chat one (``'tools[0].function.name'``)."""
    old = exc.param
    if not old or param is None or param == old:
        return
    exc.param = param
    exc.message = exc.message.replace(f"'{old}'", f"'{param}'")
    exc.args = (exc.message,)


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body for any exception.

    Anything that is not a public ``TokenRelayError`` becomes a generic 500 so no
    traceback, path or library message ever leaves the server.
    """
    if isinstance(exc, TokenRelayError) and exc.public:
        return exc.status, {
            "error": {
                "message": exc.message,
                "type": exc.type,
                "param": exc.param,
                "code": exc.code,
            }
        }
    return 500, {
        "error": {
            "message": "The server had an error while processing your request.",
            "type": "internal_error",
            "param": None,
            "code": None,
        }
    }
