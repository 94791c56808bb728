"""``app.logs``: the JSON and text formatters, the bound fields, what ``configure``
routes through logging (warnings, uncaught exceptions), and the secrets it masks."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from app import logs

ISO_MS_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture
def out(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """``configure("worker", "INFO", "json")`` onto a buffer; the root logger, the
    exception hooks and the warnings' route are put back after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    buf = io.StringIO()
    logs.configure("worker", "INFO", "json", stream=buf)
    logs.clear()
    try:
        yield buf
    finally:
        logs.clear()
        logging.captureWarnings(False)
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def lines(buf: io.StringIO) -> list[dict[str, Any]]:
    """Every line written, each parsed as JSON (one object a line, nothing else)."""
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_a_line_is_one_json_object_with_the_fields(out: io.StringIO) -> None:
    logging.getLogger("workers.runtime").info("claimed %s of %d", "r1", 2)
    (line,) = lines(out)
    assert list(line)[:6] == ["time", "level", "process", "pid", "logger", "message"]
    assert ISO_MS_UTC.match(line["time"]), line["time"]
    assert line["level"] == "INFO" and line["process"] == "worker"
    assert line["logger"] == "workers.runtime" and line["message"] == "claimed r1 of 2"
    assert isinstance(line["pid"], int)
    assert not set(logs.FIELDS) & set(line)  # none known: none written


def test_time_is_utc_with_milliseconds() -> None:
    assert logs.utc_time(0.25) == "1970-01-01T00:00:00.250Z"
    assert logs.utc_time(1_700_000_000.999) == "2023-11-14T22:13:20.999Z"


def test_fields_come_from_the_record_first_then_the_context(out: io.StringIO) -> None:
    log = logging.getLogger("t")
    logs.bind(request_id="ctx-rid", model="m1", key_id="key_abc")
    log.info("a")
    log.info("b", extra={"request_id": "rec-rid", "trace_id": "0af7", "model": ""})
    logs.clear()
    log.info("c")
    a, b, c = lines(out)
    assert (a["request_id"], a["model"], a["key_id"]) == ("ctx-rid", "m1", "key_abc")
    assert "trace_id" not in a
    assert (b["request_id"], b["trace_id"], b["model"]) == ("rec-rid", "0af7", "m1")
    assert list(b)[6:] == ["request_id", "trace_id", "model", "key_id"]  # FIELDS' order
    assert not set(logs.FIELDS) & set(c)


def test_empty_fields_are_left_out(out: io.StringIO) -> None:
    logs.bind(request_id="", trace_id="t1")
    logging.getLogger("t").warning("x", extra={"key_id": ""})
    (line,) = lines(out)
    assert "request_id" not in line and "key_id" not in line and line["trace_id"] == "t1"


def test_bound_restores_what_was_bound_before() -> None:
    logs.clear()
    logs.bind(key_id="k1")
    with logs.bound(request_id="r1", key_id="k2"):
        assert logs._bound.get() == {"key_id": "k2", "request_id": "r1"}
        with logs.bound(model="m"):
            assert logs._bound.get() == {"key_id": "k2", "request_id": "r1", "model": "m"}
        assert "model" not in logs._bound.get()
    assert logs._bound.get() == {"key_id": "k1"}
    logs.clear()
    assert logs._bound.get() == {}


def test_bind_refuses_an_unknown_field() -> None:
    with pytest.raises(TypeError, match="promt"):
        logs.bind(promt="hello")  # a typo must not pass silently


def test_fields_are_per_thread(out: io.StringIO) -> None:
    logs.bind(request_id="main")
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(logs._bound.get().get("request_id")))
    thread.start()
    thread.join()
    assert seen == [None]  # another request's thread starts with nothing bound


def test_an_exception_is_one_line_with_its_traceback(out: io.StringIO) -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logging.getLogger("t").exception("failed")
    (line,) = lines(out)
    assert line["level"] == "ERROR" and line["message"] == "failed"
    assert line["exc"].startswith("Traceback") and "ValueError: boom\nsecond line" in line["exc"]
    assert out.getvalue().count("\n") == 1


def test_an_unformattable_message_still_makes_a_line() -> None:
    record = logging.makeLogRecord({"msg": "%d items", "args": ("not a number",)})
    line = json.loads(logs.JsonFormatter("web").format(record))
    assert "%d items" in line["message"] and "unformattable" in line["message"]


def test_a_lone_surrogate_still_makes_a_json_line(out: io.StringIO) -> None:
    logging.getLogger("t").info("bytes: %s", b"\xff".decode("utf-8", "surrogateescape"))
    (line,) = lines(out)
    assert line["message"].startswith("bytes: ")


def test_configure_leaves_one_handler_and_replaces_itself(out: io.StringIO) -> None:
    root = logging.getLogger()
    root.addHandler(logging.StreamHandler(io.StringIO()))
    again = io.StringIO()
    logs.configure("streamer", "WARNING", "json", stream=again)
    assert len(root.handlers) == 1 and root.level == logging.WARNING
    logging.getLogger("t").info("dropped")
    logging.getLogger("t").warning("kept")
    assert [line["process"] for line in lines(again)] == ["streamer"]
    assert out.getvalue() == "" and logs.json_enabled()
    with pytest.raises(ValueError, match="log format"):
        logs.configure("web", "INFO", "xml")


def test_warnings_go_through_logging(out: io.StringIO) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old thing", DeprecationWarning, stacklevel=1)
    (line,) = lines(out)
    assert line["logger"] == "py.warnings" and line["level"] == "WARNING"
    assert "DeprecationWarning: old thing" in line["message"]


def test_uncaught_exceptions_go_through_logging(out: io.StringIO) -> None:
    try:
        raise RuntimeError("main thread")
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)

    def fail() -> None:
        raise KeyError("in a thread")

    thread = threading.Thread(target=fail, name="relay")
    thread.start()
    thread.join()
    quiet = threading.Thread(target=sys.exit)  # SystemExit ends a thread quietly
    quiet.start()
    quiet.join()
    main, other = lines(out)
    assert main["level"] == "CRITICAL" and "RuntimeError: main thread" in main["exc"]
    assert other["message"] == "uncaught exception in thread relay"
    assert "KeyError: 'in a thread'" in other["exc"]


def test_text_lines_keep_their_format() -> None:
    formatter = logs.TextFormatter("streamer")
    record = logging.makeLogRecord(
        {"name": "x", "levelname": "INFO", "levelno": logging.INFO, "msg": "started"}
    )
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO streamer started", formatter.format(record)
    )


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("Authorization: Bearer abc.def-123", "Authorization: Bearer ***"),
        ("key sk-tr-AbC_d-9 revoked", "key sk-tr-*** revoked"),
        ("redis://:hunter2@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://user:pw@h/1", "rediss://user:***@h/1"),
        ("GET /v1/ws?api_key=k-123&x=1 HTTP/1.1", "GET /v1/ws?api_key=***&x=1 HTTP/1.1"),
        ("api_key=k-123", "api_key=***"),
        ("max_tokens=5 token=t1", "max_tokens=5 token=***"),
        ("nothing to hide: redis://redis:6379", "nothing to hide: redis://redis:6379"),
    ],
)
def test_what_looks_like_a_secret_is_masked(text: str, masked: str) -> None:
    assert logs.redact(text) == masked


def test_secrets_are_masked_in_messages_and_tracebacks(out: io.StringIO) -> None:
    try:
        raise ConnectionError("redis://:hunter2@db:6379 refused")
    except ConnectionError:
        logging.getLogger("t").exception("header was Bearer %s", "sk-tr-s3cr3t")
    (line,) = lines(out)
    assert "hunter2" not in out.getvalue() and "s3cr3t" not in out.getvalue()
    assert line["message"] == "header was Bearer ***"


def test_key_label_never_holds_a_key_or_its_hash() -> None:
    from broker.api_keys import secret_hash

    assert logs.key_label("key_0a1b2c3d4e5f") == "key_0a1b2c3d4e5f"  # a managed key's id
    owner = secret_hash("env-key-0123456789")
    assert logs.key_label(owner) == f"env-{owner[:8]}"
    assert logs.key_label("") == ""


def test_the_web_access_log_never_holds_a_key() -> None:
    """Whatever access_log_format names (the request line, the query string, the
    credential headers), gunicorn's access line in ``tokenrelay web`` holds no key: a
    browser's WebSocket sends its key as ``?api_key=``."""
    from datetime import timedelta
    from types import SimpleNamespace

    from gunicorn.config import Config

    from web.__main__ import web_log

    log = web_log("text")(Config())
    try:
        environ = {
            "REQUEST_METHOD": "GET",
            "RAW_URI": "/v1/ws?api_key=k-123&model=m",
            "QUERY_STRING": "api_key=k-123&model=m",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "HTTP_AUTHORIZATION": "Bearer k-123",
            "HTTP_X_API_KEY": "k-123",
        }
        req = SimpleNamespace(headers=[("AUTHORIZATION", "Bearer k-123"), ("X-API-KEY", "k-123")])
        resp = SimpleNamespace(status="101 Switching Protocols", headers=[], sent=0)
        atoms = log.atoms(resp, req, environ, timedelta(milliseconds=5))
        assert "k-123" not in repr(atoms)
        assert atoms["r"] == "GET /v1/ws?api_key=***&model=m HTTP/1.1"
        assert atoms["{authorization}i"] == atoms["{x-api-key}i"] == "***"
    finally:
        for name in ("gunicorn.error", "gunicorn.access"):
            for handler in list(logging.getLogger(name).handlers):
                logging.getLogger(name).removeHandler(handler)
