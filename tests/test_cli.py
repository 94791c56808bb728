"""The ``tokenrelay`` command: built-in subcommands run in-process, external ones exec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app import cli
from app.prepare import BUNDLED_MODEL_NAME
from app.settings_docs import settings_markdown

REPO = Path(__file__).resolve().parent.parent


class ExecRecorder:
    """Stands in for os.execvp: records what would have replaced the process."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, file: str, args: list[str]) -> None:
        self.calls.append((file, list(args)))


def test_model_prepare_prints_the_directory(
    models_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["model", "prepare", "--models-dir", str(models_dir)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{models_dir / BUNDLED_MODEL_NAME}\n"
    assert "already prepared" in err  # progress goes to stderr


def test_model_prepare_uses_the_settings(
    models_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENRELAY_MODELS_DIR", str(models_dir))
    assert cli.main(["model", "prepare"]) == 0
    assert capsys.readouterr().out == f"{models_dir / BUNDLED_MODEL_NAME}\n"


def test_model_list(models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model", "list", "--models-dir", str(models_dir)]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "CONTEXT", "EOS", "IDS", "PATH"]
    path = str(models_dir / BUNDLED_MODEL_NAME)
    assert row.split() == [BUNDLED_MODEL_NAME, "8192", "2,0,4", path]


def test_model_list_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model", "list", "--models-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "no models" in err


def test_config_docs_prints_writes_and_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["config", "docs"]) == 0
    assert capsys.readouterr().out == settings_markdown()

    target = tmp_path / "docs" / "configuration.md"
    assert cli.main(["config", "docs", "--check", "--path", str(target)]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert cli.main(["config", "docs", "--write", "--path", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == settings_markdown()
    assert cli.main(["config", "docs", "--check", "--path", str(target)]) == 0

    target.write_text("stale\n", encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["config", "docs", "--check", "--path", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenrelay: error: ") and "out of date" in err


def test_the_repository_docs_are_current() -> None:
    path = REPO / "docs" / "configuration.md"
    assert cli.main(["config", "docs", "--check", "--path", str(path)]) == 0


def test_external_command_execs_python_m(monkeypatch: pytest.MonkeyPatch) -> None:
    # A module that surely exists and runs with -m stands in for a component.
    monkeypatch.setitem(cli.EXTERNAL_COMMANDS, "worker", cli.ExternalCommand("json.tool", "x"))
    recorder = ExecRecorder()
    assert cli.main(["worker", "--help", "-Q", "batch"], exec_fn=recorder) == 0
    assert recorder.calls == [
        (sys.executable, [sys.executable, "-m", "json.tool", "--help", "-Q", "batch"])
    ]


def test_missing_component_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.EXTERNAL_COMMANDS, "web", cli.ExternalCommand("no_such_pkg.web", "x"))
    recorder = ExecRecorder()
    assert cli.main(["web"], exec_fn=recorder) == 1
    assert recorder.calls == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "tokenrelay web" in err and "not installed" in err


def test_external_table_names_the_planned_components() -> None:
    assert {name: c.module for name, c in cli.EXTERNAL_COMMANDS.items()} == {
        "worker": "workers",
        "streamer": "workers.streamer",
        "web": "web",
        "batcher": "workers.batcher",
        "up": "workers.up",
        "models": "broker.models_cli",
        "metrics": "web.metrics_docs",
    }


def test_metrics_docs_hands_over_to_the_web_package() -> None:
    """``tokenrelay metrics docs`` runs in ``web.metrics_docs`` (``app/`` must not import
    ``web/``), with every option as given; tests/test_metrics_docs.py tests it there."""
    recorder = ExecRecorder()
    assert cli.main(["metrics", "docs", "--check"], exec_fn=recorder) == 0
    assert recorder.calls == [
        (sys.executable, [sys.executable, "-m", "web.metrics_docs", "docs", "--check"])
    ]


def test_model_list_served_runs_the_models_command() -> None:
    calls: list[tuple[str, list[str]]] = []
    code = cli.main(
        ["model", "list", "--served"], exec_fn=lambda exe, argv: calls.append((exe, list(argv)))
    )
    assert code == 0
    ((_exe, argv),) = calls
    assert argv[-3:] == ["-m", "broker.models_cli", "list"]


def test_runnable_module_detection() -> None:
    assert cli.is_runnable_module("json.tool")  # a plain module
    assert cli.is_runnable_module("pytest")  # a package with __main__
    assert not cli.is_runnable_module("email")  # a package without __main__
    assert not cli.is_runnable_module("no_such_pkg")
    assert not cli.is_runnable_module("no_such_pkg.sub")


def test_bad_settings_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENRELAY_PORT", "not-a-port")
    monkeypatch.delenv("TOKENRELAY_MODELS_DIR", raising=False)
    # Settings are read only by the commands that need them.
    assert cli.main(["model", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenrelay: error: invalid setting TOKENRELAY_PORT")
    assert err.count("\n") == 1


def test_unparsable_settings_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENRELAY_API_KEYS", "not json")
    assert cli.main(["model", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenrelay: error: invalid setting TOKENRELAY_API_KEYS: not valid JSON")
    assert err.count("\n") == 1


def test_model_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cli.main(["model", "prepare", "--models-dir", str(blocker / "models")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenrelay: error: ") and err.count("\n") == 1


def test_usage_errors_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["model", "bogus"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("model", "config", "worker", "streamer", "web", "up"):
        assert name in out


@pytest.mark.integration  # starts a process or opens a socket
def test_console_script_runs_without_a_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "model", "list", "--models-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 0
    assert "Traceback" not in result.stderr


@pytest.mark.integration  # starts a process or opens a socket
def test_app_imports_no_network_stack() -> None:
    code = (
        "import app, app.cli, app.model_card, app.chat_template, app.prepare; import sys; "
        "assert not {'redis','celery','flask'} & set(sys.modules), "
        "{'redis','celery','flask'} & set(sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr


def test_adding_a_file_that_does_not_exist_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.gguf"
    assert cli.main(["model", "add", str(missing), "--models-dir", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert err == f"tokenrelay: error: {missing} does not exist\n"
