"""``tokenrelay up``'s command line and what it refuses before starting anything:
``--redis-cluster N``, ports, timeouts, repeated models; and what up.json records."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.settings import Settings
from workers.up import Stack, main
from workers.up_options import parse_args

PORT_OPTIONS = ("--port", "--flower-port", "--redis-port")


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "TOKENRELAY_REDIS_URL",
        "TOKENRELAY_CELERY_URL",
        "TOKENRELAY_PORT",
        "TOKENRELAY_FLOWER_PORT",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def _signal_handlers_kept() -> Iterator[None]:
    """``main`` installs its own; the rest of the session keeps pytest's."""
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in kept.items():
        signal.signal(signum, handler)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_redis_cluster_takes_its_number_of_masters() -> None:
    assert parse_args(["--redis-cluster", "3"])[1].redis_cluster == 3
    assert parse_args([])[1].redis_cluster == 0


def test_redis_cluster_refuses_a_redis_given_by_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    err = refused(["--redis-cluster", "3", "--redis-url", "redis://elsewhere:6379/0"], capsys)
    assert "--redis-cluster starts a cluster of its own" in err
    monkeypatch.setenv("TOKENRELAY_REDIS_URL", "redis://elsewhere:6379/0")
    assert "TOKENRELAY_REDIS_URL" in refused(["--redis-cluster", "3"], capsys)


def test_redis_cluster_refuses_a_celery_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENRELAY_CELERY_URL", "redis://elsewhere:6379/0")
    assert "unset TOKENRELAY_CELERY_URL" in refused(["--redis-cluster", "3"], capsys)


@pytest.mark.parametrize("masters", ["1", "2", "-3"])
def test_redis_cluster_needs_three_masters(
    masters: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "at least 3 masters" in refused(["--redis-cluster", masters], capsys)


@pytest.mark.parametrize("flag", PORT_OPTIONS)
@pytest.mark.parametrize("value", ["0", "-1", "65536", "70000", "http"])
def test_every_port_option_takes_only_a_port_number(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Argparse refuses it, naming the flag (was: an OverflowError traceback for 70000,
    a redis-server on port 0 listening nowhere, or "invalid setting TOKENRELAY_PORT")."""
    err = refused([flag, value], capsys)
    assert err.splitlines()[-1] == (
        f"tokenrelay up: error: argument {flag}: {value!r} is not a port number (1-65535)"
    )


@pytest.mark.parametrize("flag", PORT_OPTIONS)
def test_port_options_take_the_whole_range(flag: str) -> None:
    for port in (1, 65535):
        args, _ = parse_args([flag, str(port)])
        assert getattr(args, flag.removeprefix("--").replace("-", "_")) == port


@pytest.mark.parametrize("value", ["-5", "0", "nan", "soon"])
def test_ready_timeout_must_be_positive(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["--ready-timeout", value], capsys)
    assert f"argument --ready-timeout: {value!r} is not a positive number of seconds" in err
    assert parse_args(["--ready-timeout", "0.5"])[1].ready_timeout == 0.5


def test_stop_timeout_may_be_zero_but_not_negative(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--stop-timeout", "0"])[1].stop_timeout == 0
    assert "argument --stop-timeout: '-1' is not a number of seconds" in refused(
        ["--stop-timeout", "-1"], capsys
    )


@pytest.mark.usefixtures("_signal_handlers_kept")
@pytest.mark.parametrize(
    ("argv", "env", "first", "second"),
    [
        (["--port", "8901", "--flower-port", "8901"], {}, "--port", "--flower-port"),
        (["--port", "6901", "--redis-port", "6901"], {}, "--port", "--redis-port"),
        (["--flower-port", "5901", "--redis-port", "5901"], {}, "--flower-port", "--redis-port"),
        (["--port", "8902"], {"TOKENRELAY_FLOWER_PORT": "8902"}, "--port", "--flower-port"),
    ],
)
def test_two_servers_given_one_port_are_refused_before_anything_starts(
    argv: list[str],
    env: dict[str, str],
    first: str,
    second: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Was: the port check passed and the second server crash-looped until up gave up."""
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main(["--engine", "echo", "--run-dir", str(run_dir), *argv])
    assert exited.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"tokenrelay up: error: {first} ")
    assert f" and {second}" in line and "need a port each" in line
    assert not run_dir.exists()  # no lock, no logs, no up.json


def test_a_repeated_model_is_served_once() -> None:
    """The first ``--model`` repeated too (was: a second worker set for it, its name
    listed twice in the banner)."""
    _, options = parse_args(
        ["--model", "Foo", "--model", "Bar", "--model", "Foo", "--model", "Bar"]
    )
    assert options.more_models == ("Bar",)
    stack = Stack(Settings(model="Foo", engine="echo"), options, threading.Event())
    assert stack.worker_names == ["worker", "worker-Bar"]
    assert stack.served_models() == ["Foo", "Bar"]


def test_up_json_masks_the_redis_password(tmp_path: Path) -> None:
    """As the banner and the logs do (was: the password in clear in a 0644 file)."""
    _, options = parse_args(["--run-dir", str(tmp_path)])
    settings = Settings(
        redis_url="redis://:RedisPw-s3cr3t@127.0.0.1:6733/0",
        celery_url="redis://user:CeleryPw-s3cr3t@127.0.0.1:6734/0",
    )
    stack = Stack(settings, options, threading.Event())
    stack.urls = stack.service_urls()
    stack.write_state()
    text = (tmp_path / "up.json").read_text()
    assert "s3cr3t" not in text
    urls = json.loads(text)["urls"]
    assert urls["redis"] == "redis://:***@127.0.0.1:6733/0"
    assert urls["celery"].endswith("@127.0.0.1:6734/0")


def test_models_resolved_to_one_name_are_served_once(models_dir: Path) -> None:
    """After resolution too (a .gguf file and the name it is prepared as are one model)."""
    from workers.up_models import models_to_serve

    settings = Settings(model="Foo", engine="echo", models_dir=models_dir)
    said: list[str] = []
    assert models_to_serve(settings, ("Bar", "Foo"), said.append) == ["Foo", "Bar"]


@pytest.fixture
def _logging_kept() -> Iterator[None]:
    """A JSON ``up`` configures the process's logging; the session keeps its own."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    hooks = (sys.excepthook, threading.excepthook, sys.unraisablehook)
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    sys.excepthook, threading.excepthook, sys.unraisablehook = hooks
    logging.captureWarnings(False)


@pytest.mark.usefixtures("_signal_handlers_kept", "_logging_kept")
def test_log_format_json_on_the_command_line_covers_a_bad_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--log-format json`` makes up's own lines JSON, a bad setting's too (it followed
    only TOKENRELAY_LOG_FORMAT); and a misspelt variable is a warning naming the likely
    one, in the same format."""
    monkeypatch.delenv("TOKENRELAY_LOG_FORMAT", raising=False)
    monkeypatch.setenv("TOKENRELAY_STREAM_TTL_S", "100")
    run_dir = tmp_path / "run"
    assert main(["--engine", "echo", "--log-format", "json", "--run-dir", str(run_dir)]) == 2
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["level"] == "CRITICAL" and "TOKENRELAY_STREAM_TTL_S (100)" in line["message"]
    assert not run_dir.exists()

    monkeypatch.delenv("TOKENRELAY_STREAM_TTL_S")
    monkeypatch.setenv("TOKENRELAY_WORKER_SLOT", "4")
    with pytest.raises(SystemExit):  # one port for two servers: stops before any socket
        main(["--log-format", "json", "--run-dir", str(run_dir), "--port", "8903",
              "--flower-port", "8903"])  # fmt: skip
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    warned = [x for x in lines if x["level"] == "WARNING"]
    assert warned and "did you mean TOKENRELAY_WORKER_SLOTS?" in warned[0]["message"]
