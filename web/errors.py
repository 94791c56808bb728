"""Every error the web tier answers, in OpenAI's shape, and nothing else.

``register(app)`` installs Flask error handlers so that whatever goes wrong in a route —
a ``TokenRelayError`` raised on purpose, a werkzeug ``HTTPException`` (unknown route,
wrong method, body too large) or a bug — becomes ``{"error": {"message", "type",
"param", "code"}}`` with the right status. Only our own public messages reach a client:
werkzeug's descriptions and any other exception's text are replaced (a bug is logged
here with its traceback and answered with ``app.errors.error_body``'s generic 500).
Redis being away (``broker.backbone.BACKBONE_DOWN``: refused connections, timeouts, a Redis
still loading its data, a read-only former master) is not a bug: any route that meets
it answers 503 + Retry-After, as the generation routes' fail-fast check does.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from app.errors import (
    HTTPError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    TokenRelayError,
    UnsupportedMediaType,
    error_body,
    retry_after_of,
)
from app.messages_api import ROUTE as MESSAGES_ROUTE
from app.messages_api import anthropic_error
from broker.backbone import BACKBONE_DOWN, backbone_unavailable, is_backbone_down
from web.head_first import SLOW_REQUEST_MESSAGE, SlowBody

logger = logging.getLogger(__name__)

OUTAGE_LOG_S = 10.0


def error_response(exc: BaseException) -> Response:
    """The JSON response for ``exc`` (status, OpenAI body, Retry-After for 429/503).

    Also notes the error type on ``g`` for the request metrics.
    """
    if request.path.startswith(MESSAGES_ROUTE):  # Anthropic's clients read their shape
        status, body = anthropic_error(exc)
    else:
        status, body = error_body(exc)
    g.error_type = body["error"]["type"]
    response = jsonify(body)
    response.status_code = status
    retry_after = retry_after_of(exc)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


def translate_http_exception(exc: HTTPException) -> TokenRelayError:
    """Our own error for a werkzeug one, so no library description reaches a client."""
    status = exc.code or 500
    if status == 404:
        return NotFound(f"Unknown route: {request.method} {request.path}", code="unknown_route")
    if status == 405:
        return MethodNotAllowed(f"Method {request.method} is not allowed for {request.path}.")
    if status == 413:
        limit = request.max_content_length
        return PayloadTooLarge(
            "The request body is too large"
            + (f" (at most {limit} bytes are accepted)." if limit else ".")
        )
    if status == 415:
        return UnsupportedMediaType("The request body must be JSON (application/json).")
    if status == 400:
        return InvalidRequest("The request could not be parsed.")
    return HTTPError(status)


def register(app: Flask) -> None:
    """Install the error handlers on ``app``."""

    @app.errorhandler(TokenRelayError)
    def _tokenrelay_error(exc: TokenRelayError) -> Response:
        if not exc.public:
            logger.error("internal error: %s", exc, exc_info=exc)
        return error_response(exc)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Any:
        if exc.code is not None and exc.code < 400:  # redirects are not errors
            return exc
        return error_response(translate_http_exception(exc))

    # One log line per OUTAGE_LOG_S at most: during an outage every request would
    # otherwise log the same thing (the 503s are counted in the request metrics).
    last_logged = [-OUTAGE_LOG_S]

    def _backbone_down(exc: Exception) -> Response:
        now = time.monotonic()
        if now - last_logged[0] >= OUTAGE_LOG_S:
            last_logged[0] = now
            logger.warning("%s %s: redis unavailable (%s)", request.method, request.path, exc)
        return error_response(backbone_unavailable())

    for outage in BACKBONE_DOWN:
        app.register_error_handler(outage, _backbone_down)

    @app.errorhandler(redis.ResponseError)
    def _redis_error(exc: redis.ResponseError) -> Response:
        # A write refused at maxmemory inside a Lua script (a plain script error).
        return _backbone_down(exc) if is_backbone_down(exc) else _bug(exc)

    @app.errorhandler(SlowBody)
    def _slow_body(exc: SlowBody) -> Response:
        response = error_response(RequestTimeout(SLOW_REQUEST_MESSAGE))
        response.headers["Connection"] = "close"  # the rest of its body is still coming
        return response

    @app.errorhandler(Exception)
    def _bug(exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(exc)
