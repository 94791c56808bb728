"""The one lenient JSON reader: HTTP bodies, WebSocket messages and batch input lines.

Clients in the wild send raw control characters (a pasted tab or newline, a terminal's
colour codes) and broken UTF-8 inside JSON strings. Strict parsers answer 400 and the
user loses their prompt; like the seed (Dynamo's ``openai.rs``), we repair instead:

- invalid UTF-8 becomes U+FFFD (``String::from_utf8_lossy``); a leading BOM is dropped;
- a raw control character inside a string is kept as that character, also right after
  a backslash: ``"slash \\<LF>next"`` reads as ``slash \\`` + newline + ``next`` (the
  seed's ``escape_json_string_control_chars`` turns the backslash into an escaped one
  and the control character into ``\\u00XX``);
- a lone surrogate from a ``\\ud800``-style escape becomes U+FFFD, since the tokenizer
  could not encode it.

Text that is not JSON at all, an empty body, or nesting deeper than ``MAX_DEPTH`` raises
``InvalidRequest`` (400) with our own message, never the parser's. The depth bound is
checked without recursion right after parsing, so no later step (the surrogate repair,
validation, ``json.dumps`` of the record) can meet a ``RecursionError``: a hostile body
of a thousand nested lists is one 400, never a 500 or a traceback in the log.
"""

from __future__ import annotations

import json
import re
from typing import Any

from app.errors import InvalidRequest

__all__ = ["MAX_DEPTH", "escape_control_chars_in_strings", "loads_embedded", "loads_lenient"]

# Deepest nesting of arrays and objects accepted. Real requests nest a handful of levels
# (a JSON schema in a tool or response_format a few dozen at most).
MAX_DEPTH = 128

# One JSON string from its opening quote: plain characters or backslash pairs (a pair
# may be a backslash and a raw control character), then the closing quote if any.
# Outside strings there is no quote, so the next quote always opens a string.
_STRING = re.compile(r'"(?:[^"\\]+|\\[\s\S])*"?')
# Inside a string: a backslash pair (kept unless its second character is a control
# character) or a lone raw control character.
_INSIDE = re.compile(r"\\[\s\S]|[\x00-\x1f]")
_CONTROL = re.compile(r"[\x00-\x1f]")


def _escape_piece(match: re.Match[str]) -> str:
    piece = match.group()
    if piece[0] == "\\":
        if piece[1] > "\x1f":
            return piece  # an ordinary escape: \n, \", \\, \u...
        # A backslash then a raw control character is no JSON escape: keep both, the
        # backslash as an escaped backslash (as the seed writes ``\\\\u00XX``).
        return f"\\\\\\u{ord(piece[1]):04x}"
    return f"\\u{ord(piece):04x}"


def _escape_string(match: re.Match[str]) -> str:
    return _INSIDE.sub(_escape_piece, match.group())


def escape_control_chars_in_strings(text: str) -> str | None:
    """``text`` with raw control characters inside JSON strings escaped, or ``None``
    when there are none (the seed's ``escape_json_string_control_chars``).

    Control characters outside strings (whitespace between tokens) are left alone.
    """
    if _CONTROL.search(text) is None:
        return None
    escaped = _STRING.sub(_escape_string, text)
    return None if escaped == text else escaped


def loads_lenient(raw: bytes | str) -> Any:
    """Parse JSON, repairing invalid UTF-8, raw control characters and lone surrogates.

    Raises ``InvalidRequest`` (400) for an empty body, text that is not JSON, or nesting
    too deep, with a message of our own (the parser's text never reaches a client).
    """
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise InvalidRequest("The request body is empty; a JSON object is required.")
    try:
        value = _loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"The request body is not valid JSON (line {exc.lineno}, column {exc.colno})."
        ) from exc
    except RecursionError as exc:
        raise _too_deep() from exc
    # Only text with more brackets than the bound can nest past it: most bodies skip
    # the walk after two fast counts.
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth_exceeds(value, MAX_DEPTH):
        raise _too_deep()
    if "\\ud" in text or "\\uD" in text:
        value = _replace_lone_surrogates(value)
    return value


def loads_embedded(text: str) -> Any:
    """JSON text inside a request's JSON (a tool call's ``arguments``, a schema sent as
    a string), read with a body's guarantees: lone surrogates repaired, nesting bounded
    (``json.loads`` alone would hand the tokenizer a lone surrogate, or raise
    ``RecursionError``: both a 500). Raises ``ValueError`` when it is not JSON or
    nests too deeply, as ``json.loads`` would for the first."""
    try:
        return loads_lenient(text)
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"The request body is nested too deeply (at most {MAX_DEPTH} levels).")


def _depth_exceeds(value: Any, most: int) -> bool:
    """Whether arrays/objects in ``value`` nest deeper than ``most`` (iterative)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > most:
                    return True
                stack.append((child, depth + 1))
    return False


def _loads(text: str) -> Any:
    """``json.loads`` that keeps raw control characters inside strings.

    ``strict=False`` already keeps them, except right after a backslash (an invalid
    escape to Python): only then is the text escaped and parsed again. A failure of
    the second parse reports the first one's position, which is in the client's text.
    """
    try:
        return json.loads(text, strict=False)
    except json.JSONDecodeError as first:
        escaped = escape_control_chars_in_strings(text)
        if escaped is None:
            raise
        try:
            return json.loads(escaped, strict=False)
        except json.JSONDecodeError:
            raise first from None


def _fix(s: str) -> str:
    return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _replace_lone_surrogates(value: Any) -> Any:
    """``value`` with every string (keys included) repaired, walked with an explicit
    stack rather than recursion, so no nesting depth can raise ``RecursionError``."""
    if isinstance(value, str):
        return _fix(value)
    if not isinstance(value, dict | list):
        return value
    root: list[Any] = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]  # (container, key or index) to repair
    while stack:
        parent, slot = stack.pop()
        item = parent[slot]
        if isinstance(item, str):
            parent[slot] = _fix(item)
        elif isinstance(item, list):
            copy = list(item)
            parent[slot] = copy
            stack.extend((copy, i) for i in range(len(copy)))
        elif isinstance(item, dict):
            copy_d = {_fix(k): v for k, v in item.items()}
            parent[slot] = copy_d
            stack.extend((copy_d, k) for k in copy_d)
    return root[0]
