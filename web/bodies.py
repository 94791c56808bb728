"""Reading JSON request bodies the way the seed did: repair, don't reject.

Clients in the wild send raw control characters (a pasted tab or newline) and broken
UTF-8 inside JSON strings. Strict parsers answer 400 and the user loses their prompt;
we decode bytes with ``errors="replace"`` (broken bytes become U+FFFD), parse with
``json.loads(strict=False)`` (control characters are kept as text) and replace lone
surrogates from ``\\ud800``-style escapes, which the tokenizer could not encode.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Request

from app.errors import InvalidRequest, UnsupportedMediaType


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (
        mimetype.startswith("application/") and mimetype.endswith("+json")
    )


def json_body(req: Request) -> Any:
    """The request's JSON body: 415 when it is not JSON, 413 (werkzeug) when too large."""
    if not is_json_mimetype(req.mimetype):
        raise UnsupportedMediaType(
            "The request body must be JSON: send 'Content-Type: application/json'."
        )
    return loads_repaired(req.get_data(cache=False))


def loads_repaired(raw: bytes | str) -> Any:
    """Parse JSON, repairing invalid UTF-8, raw control characters and lone surrogates.

    Raises ``InvalidRequest`` (400) for text that is not JSON at all, without the
    parser's own message.
    """
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise InvalidRequest("The request body is empty; a JSON object is required.")
    try:
        value = json.loads(text, strict=False)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"The request body is not valid JSON (line {exc.lineno}, column {exc.colno})."
        ) from exc
    except RecursionError as exc:
        raise InvalidRequest("The request body is nested too deeply.") from exc
    if "\\ud" in text or "\\uD" in text:
        value = _replace_lone_surrogates(value)
    return value


def _fix(s: str) -> str:
    return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _replace_lone_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return _fix(value)
    if isinstance(value, list):
        return [_replace_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_fix(k): _replace_lone_surrogates(v) for k, v in value.items()}
    return value
