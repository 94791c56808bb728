"""The grammar a constrained choice is sampled under, and the check that it can be.

An ``OutputConstraint`` (app/messages.py) says a choice's output must be ``prefix`` + one
JSON value + ``suffix``, then EOS. The engines enforce it with llguidance (see
docs/architecture.md, "Constrained decoding", for why): each step they ask an
``LLMatcher`` for the tokens the grammar allows and mask the rest. This module builds
that grammar as text (llguidance's Lark dialect with an embedded ``%json`` schema) and
checks it without a tokenizer, so the web tier can answer 400 naming an unsupported
schema feature before a request is queued, and the engines compile exactly the grammar
that was checked.

It imports llguidance only (a Rust extension with no dependencies), never llama.cpp or
exllamav2.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from app.errors import InvalidRequest
from app.lenient_json import loads_embedded
from app.records import OutputConstraint

# How the JSON is laid out. llguidance's default allows any run of whitespace between
# tokens; a small model then easily spends its whole budget on newlines. Fixed
# separators (those of Python's json.dumps) leave the model no whitespace to choose.
# ``lenient`` stays off: an unknown keyword is an error, never silently dropped.
JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
_COMPILE_ERROR = "failed to compile JSON schema: "

# OpenAI's limits on a structured-output schema: what a client of its API already keeps
# to, and what keeps a grammar's compilation well under a second here (10,000 required
# properties took one second to compile, 5,000 took a quarter of one).
MAX_SCHEMA_PROPERTIES = 5000
MAX_SCHEMA_NESTING = 10
MAX_SCHEMA_ENUM_VALUES = 1000
MAX_SCHEMA_STRING_CHARS = 120_000


def check_schema_size(schema: Any) -> None:
    """Raise ``InvalidRequest`` when ``schema`` exceeds OpenAI's structured-output
    limits: object properties in all, nesting of objects, enum values in all, and the
    characters of every property name, enum and const value together."""
    properties = enums = chars = 0
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            stack += [(item, depth) for item in node]
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict):
            depth += 1
            if depth > MAX_SCHEMA_NESTING:
                raise InvalidRequest(
                    f"the schema nests objects more than {MAX_SCHEMA_NESTING} levels deep"
                )
            properties += len(props)
            chars += sum(len(str(name)) for name in props)
        enum, const = node.get("enum"), node.get("const")
        if isinstance(enum, list):
            enums += len(enum)
            chars += sum(len(v) for v in enum if isinstance(v, str))
        if isinstance(const, str):
            chars += len(const)
        if properties > MAX_SCHEMA_PROPERTIES:
            raise InvalidRequest(
                f"the schema has more than {MAX_SCHEMA_PROPERTIES} object properties in all"
            )
        if enums > MAX_SCHEMA_ENUM_VALUES:
            raise InvalidRequest(
                f"the schema has more than {MAX_SCHEMA_ENUM_VALUES} enum values in all"
            )
        if chars > MAX_SCHEMA_STRING_CHARS:
            raise InvalidRequest(
                "the schema's property names, enum and const values have more than "
                f"{MAX_SCHEMA_STRING_CHARS} characters in all"
            )
        stack += [(value, depth) for value in node.values()]


def _schema_dict(schema: dict[str, Any] | str) -> dict[str, Any]:
    """The schema as a dict, with our layout options in place of any client's own.

    llguidance reads options from a schema's ``x-guidance`` key; a client's could turn
    on ``lenient`` and so make unsupported keywords pass unenforced.
    """
    if isinstance(schema, str):
        try:
            schema = loads_embedded(schema)
        except ValueError as exc:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise InvalidRequest("the JSON schema must be a JSON object")
    check_schema_size(schema)
    return {**schema, "x-guidance": JSON_LAYOUT}


def _lark_literal(text: str) -> str:
    # A JSON string is a valid Lark string literal in llguidance's grammar syntax
    # (same escapes), which keeps quotes, backslashes and newlines exact.
    return json.dumps(text, ensure_ascii=False)


def grammar_text(schema: dict[str, Any] | str, prefix: str = "", suffix: str = "") -> str:
    """llguidance's grammar for ``prefix`` + one JSON value matching ``schema`` + ``suffix``."""
    body = json.dumps(_schema_dict(schema), ensure_ascii=False)
    parts = [_lark_literal(prefix)] if prefix else []
    parts.append("value")
    if suffix:
        parts.append(_lark_literal(suffix))
    lark = f"start: {' '.join(parts)}\nvalue: %json {body}\n"
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def constraint_grammar(constraint: OutputConstraint) -> str:
    """The grammar an engine compiles for ``constraint`` (the one ``check_constraint``
    validated)."""
    schema: dict[str, Any] | str = (
        ANY_OBJECT if constraint.json_schema is None else constraint.json_schema
    )
    return grammar_text(schema, constraint.prefix, constraint.suffix)


def _problem(grammar: str) -> str | None:
    """llguidance's reason ``grammar`` cannot be compiled, shortened to its first line
    (the rest is an excerpt of the grammar text), or None when it compiles."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if not error:
        return None
    first = error.strip().splitlines()[0]
    if _over_limit(first):
        return "it is too complex: its grammar exceeds this server's limits"
    at = first.find(_COMPILE_ERROR)
    return first[at + len(_COMPILE_ERROR) :] if at >= 0 else first


def grammar_problem(constraint: OutputConstraint) -> str | None:
    """Why ``constraint`` cannot be enforced (the feature, as llguidance names it), or
    None. Engines call it again on the worker; the web tier calls ``check_constraint``."""
    try:
        return _problem(constraint_grammar(constraint))
    except InvalidRequest as exc:
        return exc.message


# What an llguidance error says when the grammar outgrew a parser limit (the lexer's
# states or fuel, a row's items, the grammar's size), rather than being wrong.
_LIMIT_MARKERS = ("too many", "max is", "fuel", "too large", "too big", "limit", "exceeded")


def _over_limit(error: str) -> bool:
    return any(marker in error.lower() for marker in _LIMIT_MARKERS)


def public_grammar_error(internal: str) -> str:
    """What a client reads when a constraint's grammar fails while a worker compiles or
    follows it: plain words, never llguidance's internal text (parser states, timings,
    item counts), which goes to the worker's log instead."""
    if _over_limit(internal):
        return (
            "this JSON schema is too complex to enforce: its grammar exceeds this "
            "server's limits (use fewer properties, alternatives or shorter patterns)"
        )
    return "the output grammar failed: the output no longer fits the requested format"


def check_schema_supported(schema: dict[str, Any] | str) -> None:
    """Raise ``InvalidRequest`` naming the feature when ``schema`` cannot be enforced.

    Unsupported are e.g. ``uniqueItems``, ``not``, ``if``/``then``/``else``,
    ``contains``, remote ``$ref`` and unknown ``format`` values, and schemas nothing can
    satisfy (a required property that ``additionalProperties: false`` forbids).
    """
    problem = _problem(grammar_text(schema))
    if problem is not None:
        raise InvalidRequest(
            f"this JSON schema cannot be enforced: {problem}", param="response_format"
        )


def check_constraint(constraint: OutputConstraint) -> None:
    """``check_schema_supported`` for exactly the grammar the engine will build."""
    problem = grammar_problem(constraint)
    if problem is not None:
        raise InvalidRequest(f"this JSON schema cannot be enforced: {problem}")


__all__ = [
    "JSON_LAYOUT",
    "check_constraint",
    "check_schema_size",
    "check_schema_supported",
    "constraint_grammar",
    "grammar_problem",
    "grammar_text",
    "public_grammar_error",
]
