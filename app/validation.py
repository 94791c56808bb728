"""Request validation errors as OpenAI reports them: one 400 whose ``param`` names the field.

``app.protocol`` (the generation endpoints) and ``app.tools`` (tool and response-format
fields) validate with pydantic models built on ``RequestModel``; a validator raises
``invalid(message, subpath=...)`` for a client-ready message, and
``validation_error_to_invalid_request`` turns pydantic's ``ValidationError`` into the
``InvalidRequest`` the web tier answers with.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from app.errors import InvalidRequest


def invalid(message: str, *, subpath: str | None = None) -> PydanticCustomError:
    """A validation error with a client-ready message.

    ``subpath`` extends the error's location (a model validator's error has none of its
    own): ``"stream_options"`` or ``"[2].type"``.
    """
    return PydanticCustomError("invalid_request", message, {"subpath": subpath})


def _format_loc(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _short(value: Any) -> str | None:
    if isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= 40):
        return repr(value)
    return None


def _join_path(param: str, subpath: str) -> str:
    return param + subpath if subpath.startswith("[") or not param else f"{param}.{subpath}"


def _unknown_fields(errors: Iterable[Any]) -> list[str]:
    """The paths of every unrecognized field, in the order pydantic found them."""
    names: list[str] = []
    for err in errors:
        if err["type"] != "extra_forbidden":
            continue
        param = _format_loc(err["loc"])
        ctx = err.get("ctx") or {}
        subpaths = [ctx["subpath"], *ctx.get("also", ())] if ctx.get("subpath") else [""]
        names += [_join_path(param, sub) if sub else param for sub in subpaths]
    return [n for n in dict.fromkeys(names) if n]


def validation_error_to_invalid_request(exc: ValidationError) -> InvalidRequest:
    """The 400 for a request that failed validation.

    Unrecognized fields come first and are all named in one message, so a client fixes
    them in one round trip (``"Unrecognized request arguments supplied: a, b"``);
    otherwise the first error is reported, like OpenAI. ``param`` is the offending
    field's path, e.g. ``"temperature"``, ``"messages[0].role"``, ``"stream_options"``
    (the first unknown field's); ``None`` when the body itself is wrong.
    """
    errors = exc.errors(include_url=False)
    if not errors:  # pragma: no cover - pydantic never raises an empty ValidationError
        return InvalidRequest("Invalid request.")
    unknown = _unknown_fields(errors)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        return InvalidRequest(
            f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}",
            param=unknown[0],
        )
    err = errors[0]
    param = _format_loc(err["loc"])
    ctx = err.get("ctx") or {}
    subpath = ctx.get("subpath")
    if subpath:
        param = _join_path(param, subpath)
    kind = err["type"]
    if kind == "invalid_request":
        message = err["msg"]
    elif not param:
        message = "The request body must be a JSON object."
    elif kind == "missing":
        message = f"Missing required parameter: '{param}'."
    else:
        got = _short(err.get("input"))
        suffix = f" (got {got})" if got is not None else ""
        message = f"Invalid value for '{param}': {err['msg']}{suffix}."
    return InvalidRequest(message, param=param or None)


class RequestModel(BaseModel):
    """A request body or part of one: unknown fields and NaN/Infinity are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
