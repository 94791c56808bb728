"""Log lines: one handler on stderr per process, as text or as one JSON object a line.

``configure(kind, level, fmt)`` is called once by each process's entry point (web,
worker, streamer, batcher, flower, up) with ``Settings.log_format``; library code only
logs (``logging.getLogger(__name__)``). In JSON mode nothing a process prints should be
anything else: warnings and uncaught exceptions (main thread, other threads, and
"exception ignored" ones) go through logging too.

A JSON line holds ``time`` (UTC, ISO-8601 with milliseconds), ``level``, ``process``
(the kind), ``pid``, ``logger``, ``message``, then whichever of ``request_id``,
``trace_id``, ``model`` and ``key_id`` are known (``FIELDS``; empty ones are left out)
and ``exc`` (the formatted traceback) for an exception. A field comes from the record
(``logger.info(..., extra={"request_id": rid})``) or else from the fields bound to the
current context (``bind``, ``bound``): a request's thread binds them once and every
line it logs carries them.

No secret belongs in a log: ``key_id`` is a key's id or a short label, never the key.
As a safety net both formats also mask what looks like one in a message or traceback
(``redact``: a bearer token, a managed key's secret, a URL's password, a key in a
query string).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import orjson

if TYPE_CHECKING:
    from app.settings import Settings

__all__ = [
    "FIELDS",
    "KINDS",
    "JsonFormatter",
    "TextFormatter",
    "bind",
    "bound",
    "clear",
    "configure",
    "json_enabled",
    "key_label",
    "redact",
]

#: The per-request fields a line may carry, in the order they are written.
FIELDS = ("request_id", "trace_id", "model", "key_id")
#: The process kinds (``process`` in a JSON line).
KINDS = ("web", "worker", "streamer", "batcher", "flower", "up")

_NOTHING: Mapping[str, str] = MappingProxyType({})
_bound: ContextVar[Mapping[str, str]] = ContextVar("tokenrelay_log_fields", default=_NOTHING)


# -- the context ----------------------------------------------------------------------------


def _checked(fields: Mapping[str, str]) -> dict[str, str]:
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise TypeError(f"unknown log fields {sorted(unknown)}; known: {', '.join(FIELDS)}")
    return dict(fields)


def bind(**fields: str) -> None:
    """Set ``fields`` (``FIELDS``) on the current context, keeping the others bound."""
    _bound.set({**_bound.get(), **_checked(fields)})


def clear() -> None:
    """Forget every bound field (a thread starting on a new request)."""
    _bound.set(_NOTHING)


@contextmanager
def bound(**fields: str) -> Iterator[None]:
    """``fields`` bound for the block; what was bound before is back after it."""
    token = _bound.set({**_bound.get(), **_checked(fields)})
    try:
        yield
    finally:
        _bound.reset(token)


def key_label(owner: str) -> str:
    """The ``key_id`` of a request made with a key whose owner id (``web.auth.Tenant``)
    is ``owner``: a managed key's id (``key_...``) as it is; an environment key's owner,
    which is the key's SHA-256, cut to a label (``env-`` and 8 hex digits) that tells
    keys apart and gives nothing to look the key up with."""
    if not owner or owner.startswith("key_"):
        return owner
    return f"env-{owner[:8]}"


# -- secrets ---------------------------------------------------------------------------------

_SECRETS = (
    (re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+"), r"\1***"),
    (re.compile(r"\bsk-tr-[A-Za-z0-9_\-]+"), "sk-tr-***"),
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s/:@]*:)[^\s/@]+@"), r"\1***@"),
    (
        re.compile(
            r"(?i)((?<![A-Za-z0-9_])(?:api[_-]?key|access[_-]?token|token|password|secret)=)"
            r"[^&\s\"']+"
        ),
        r"\1***",
    ),
)


def redact(text: str) -> str:
    """``text`` with what looks like a secret masked: ``Bearer <token>``, a managed key
    (``sk-tr-...``), the password in ``scheme://user:password@host``, and the value of
    an ``api_key``/``token``/``password`` query parameter."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


# -- formatters ------------------------------------------------------------------------------


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception as exc:  # a bad %-format must not lose the line (or print a traceback)
        return f"{record.msg!r} % {record.args!r} (unformattable: {exc})"


def utc_time(created: float) -> str:
    """``created`` (a ``time.time()``) as ISO-8601 UTC with milliseconds."""
    ms = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{ms:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module docstring)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        out: dict[str, Any] = {
            "time": utc_time(record.created),
            "level": record.levelname,
            "process": self.kind,
            "pid": record.process,
            "logger": record.name,
            "message": redact(_message(record)),
        }
        context = _bound.get()
        for name in FIELDS:
            value = getattr(record, name, None) or context.get(name)
            if value:
                out[name] = value if isinstance(value, str) else str(value)
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc"] = redact(record.exc_text)
        if record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info))
        return out

    def format(self, record: logging.LogRecord) -> str:
        fields = self.fields(record)
        try:
            return orjson.dumps(fields, default=str).decode()
        except (TypeError, orjson.JSONEncodeError):  # e.g. a lone surrogate in a message
            return json.dumps(fields, default=str)


class TextFormatter(logging.Formatter):
    """``<local time> <LEVEL> <kind> <message>``: the text format every loop process
    has always written (tracebacks on the lines after)."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {kind} %(message)s")
        self.kind = kind

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


# -- installing ------------------------------------------------------------------------------

_uncaught = logging.getLogger("uncaught")


def _log_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    _uncaught.critical("uncaught exception", exc_info=(exc_type, exc, tb))


def _log_thread_uncaught(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as threading's own hook: a thread's normal way out
        return
    name = args.thread.name if args.thread is not None else "?"
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    _uncaught.error(
        "uncaught exception in thread %s", name, exc_info=(args.exc_type, exc, args.exc_traceback)
    )


def _log_unraisable(args: Any) -> None:  # sys.UnraisableHookArgs
    try:
        where = f"{args.err_msg or 'Exception ignored in'}: {args.object!r}"
    except Exception:
        where = args.err_msg or "Exception ignored"
    exc_info = (args.exc_type, args.exc_value, args.exc_traceback) if args.exc_value else None
    _uncaught.warning("%s", where, exc_info=exc_info)


def configure(
    kind: str, level: str | int, fmt: str, *, stream: TextIO | None = None
) -> logging.Handler:
    """Make the root logger's only handler one on ``stream`` (stderr) in ``fmt``
    (``"text"`` or ``"json"``) at ``level``, and route warnings and uncaught exceptions
    through logging. Calling it again replaces what it installed; returns the handler."""
    if fmt not in ("text", "json"):
        raise ValueError(f"unknown log format {fmt!r} (text or json)")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(kind) if fmt == "json" else TextFormatter(kind))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_thread_uncaught
    sys.unraisablehook = _log_unraisable
    return handler


def json_enabled() -> bool:
    """Whether this process logs JSON (``configure`` installed a JSON handler)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


# -- settings errors, before logging is configured -------------------------------------------


def settings_problem(exc: Exception) -> str:
    """One line saying what is wrong with the settings (pydantic's ``ValidationError``:
    the first error's variable and message; pydantic-settings' ``SettingsError``, e.g.
    a list variable that is not JSON: its message)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        cause = first.get("ctx", {}).get("error")
        said = str(cause) if first["type"] == "value_error" and cause else first["msg"]
        if not first["loc"]:  # a check across settings: its message names them
            return f"invalid settings: {said}"
        where = str(first["loc"][0])
        if first["type"] == "string_pattern_mismatch":  # the pattern alone says little
            said += f": {_described(where)}"
        return f"invalid setting TOKENRELAY_{where.upper()}: {said}"
    field = re.search(r'field "(\w+)"', str(exc))  # pydantic-settings' SettingsError
    if field is not None:
        return (
            f"invalid setting TOKENRELAY_{field.group(1).upper()}: not valid JSON (list "
            """and object settings are JSON, e.g. TOKENRELAY_API_KEYS='["k1"]')"""
        )
    return f"invalid settings: {exc}"


def _described(field: str) -> str:
    from app.settings import Settings

    info = Settings.model_fields.get(field)
    return (info.description or "") if info is not None else ""


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """``TOKENRELAY_*`` variables that name no setting, each with the setting it is
    most likely meant to be (a misspelt TOKENRELAY_API_KEY would leave keys off)."""
    from app.settings import Settings

    known = [f"TOKENRELAY_{name.upper()}" for name in Settings.model_fields]
    out = []
    for name in sorted(n for n in environ if n.startswith("TOKENRELAY_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1)
        out.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return out


def settings_or_exit(kind: str, **overrides: Any) -> Settings:
    """The settings from the environment (``overrides`` on top), or exit with status 2
    and one line saying what is wrong. Logging is not configured yet (the settings say
    how), so the line follows ``TOKENRELAY_LOG_FORMAT`` as the environment has it: a
    JSON log line when it says json (every line of a JSON process parses), else
    ``tokenrelay <kind>: error: ...`` on stderr, never a traceback."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from app.settings import Settings

    try:
        settings = Settings(**overrides)
    except (ValidationError, SettingsError) as exc:
        report_settings_problem(kind, exc)
        raise SystemExit(2) from None
    warn_unknown_variables(kind)
    return settings


def warn_unknown_variables(kind: str, fmt: str | None = None) -> None:
    """A warning naming each ``TOKENRELAY_*`` variable that names no setting (they are
    ignored), in ``report_settings_problem``'s format."""
    unknown = unknown_variables(os.environ)
    if unknown:
        said = f"ignoring variables that name no setting: {', '.join(unknown)}"
        report_settings_problem(kind, said, warning=True, fmt=fmt)


def report_settings_problem(
    kind: str, exc: Exception | str, *, warning: bool = False, fmt: str | None = None
) -> None:
    """``settings_or_exit``'s line about ``exc`` (or a ``warning`` said as it is), in
    the log format ``fmt`` (a command line's ``--log-format``), else the environment's."""
    problem = exc if isinstance(exc, str) else settings_problem(exc)
    fmt = fmt or os.environ.get("TOKENRELAY_LOG_FORMAT", "")
    if fmt.strip().lower() == "json":
        configure(kind, "INFO", "json")
        log = logging.getLogger(f"tokenrelay.{kind}")
        log.log(logging.WARNING if warning else logging.CRITICAL, "%s", problem)
    else:
        said = "warning" if warning else "error"
        print(f"tokenrelay {kind}: {said}: {problem}", file=sys.stderr, flush=True)
