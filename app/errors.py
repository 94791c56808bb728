"""tokenrelay's exception tree and its one mapping to the OpenAI error body.

    TokenRelayError                      500 internal_error (generic message only)
    ├── InvalidRequest                   400 invalid_request_error
    │   └── ContextLengthExceeded        400 (prompt + max_tokens over the context)
    ├── AuthenticationFailed             401 authentication_error
    ├── NotFound                         404 not_found_error
    ├── PayloadTooLarge                  413
    ├── UnsupportedMediaType             415
    ├── QueueFull                        429 rate_limit_error (carries Retry-After)
    ├── NotImplementedFeature            501
    ├── ServiceUnavailable               503
    └── ModelError                       model directories that cannot be read

Library errors are translated at the edge with ``raise X from exc``; only the
messages of these classes ever reach a client.
"""

from __future__ import annotations

from typing import Any


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


class NotFound(TokenRelayError):
    status = 404
    type = "not_found_error"
    public = True


class PayloadTooLarge(TokenRelayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"
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


class NotImplementedFeature(TokenRelayError):
    status = 501
    type = "not_implemented_error"
    public = True


class ServiceUnavailable(TokenRelayError):
    status = 503
    type = "service_unavailable_error"
    public = True


class ModelError(TokenRelayError):
    """A model directory is missing or malformed (an operator's problem)."""

    public = True


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
