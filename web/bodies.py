"""Reading JSON request bodies over HTTP: the content type here, the repair in app/.

The lenient reader itself (broken UTF-8, raw control characters, lone surrogates) is
``app.lenient_json.loads_lenient``, shared with WebSocket messages and batch lines;
this module only adds what is Flask's: the request's content type and its bytes.
"""

from __future__ import annotations

from typing import Any

from flask import Request

from app.errors import UnsupportedMediaType
from app.lenient_json import loads_lenient
from app.tracecontext import TRACEPARENT, TRACESTATE

__all__ = ["is_json_mimetype", "json_body", "loads_repaired"]

# The name the WebSocket handler and older tests import.
loads_repaired = loads_lenient


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (
        mimetype.startswith("application/") and mimetype.endswith("+json")
    )


def client_trace(req: Request) -> dict[str, str]:
    """The W3C trace context the client sent (``traceparent``, ``tracestate``): the
    parent of the request's trace (``broker.tracing``); empty when it sent none."""
    return {h: v for h in (TRACEPARENT, TRACESTATE) if (v := req.headers.get(h))}


def json_body(req: Request) -> Any:
    """The request's JSON body: 415 when it is not JSON, 413 (werkzeug) when too large."""
    if not is_json_mimetype(req.mimetype):
        raise UnsupportedMediaType(
            "The request body must be JSON: send 'Content-Type: application/json'."
        )
    return loads_lenient(req.get_data(cache=False))
