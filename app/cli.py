"""The ``tokenrelay`` command.

Two kinds of subcommands:

* built in, implemented here on top of ``app/`` alone: ``model prepare``,
  ``model list``, ``config docs``;
* external, listed in ``EXTERNAL_COMMANDS``: the long-running processes (worker,
  streamer, web, batcher, up) and the tools that read Redis or the web tier's metrics
  (``models``, ``metrics docs``) live in packages that ``app/`` must not import (they
  pull in Redis, Celery and Flask). ``tokenrelay worker ARGS`` replaces this process with
  ``python -m workers ARGS``, so signals, exit codes and ``--help`` are the
  component's own. Adding one is a line in the table plus a ``__main__`` module.

Every error is one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import SettingsError

from app.errors import TokenRelayError
from app.logs import settings_problem
from app.settings import Settings
from app.settings_docs import settings_markdown

PROG = "tokenrelay"
DEFAULT_DOCS_PATH = Path("docs") / "configuration.md"

ExecFn = Callable[[str, list[str]], None]


@dataclass(frozen=True)
class ExternalCommand:
    """A subcommand run as ``python -m <module> ...`` in place of this process."""

    module: str
    help: str


EXTERNAL_COMMANDS: dict[str, ExternalCommand] = {
    "worker": ExternalCommand("workers", "run a Celery GPU/CPU worker (python -m workers)"),
    "streamer": ExternalCommand(
        "workers.streamer", "run a streamer: token ids -> text deltas (python -m workers.streamer)"
    ),
    "web": ExternalCommand("web", "run the web server (python -m web)"),
    "batcher": ExternalCommand(
        "workers.batcher", "run a batch driver for /v1/batches (python -m workers.batcher)"
    ),
    "up": ExternalCommand(
        "workers.up", "run the whole stack on this machine (python -m workers.up)"
    ),
    "models": ExternalCommand(
        "broker.models_cli", "list the models served on the Redis, or forget one"
    ),
    "metrics": ExternalCommand(
        "web.metrics_docs",
        "metrics docs: docs/operations.md's table of every metric (python -m web.metrics_docs)",
    ),
}


class CommandError(Exception):
    """A failure to report as one line (exit status 1, or ``status``)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def main(argv: Sequence[str] | None = None, *, exec_fn: ExecFn = os.execvp) -> int:
    """Entry point of the ``tokenrelay`` console script; returns the exit status.

    ``exec_fn`` replaces the process for external subcommands; tests pass a recorder.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list and args_list[0] in EXTERNAL_COMMANDS:
            # Before argparse, so every option (even --help) reaches the component.
            return run_external(args_list[0], args_list[1:], exec_fn=exec_fn)
        args = build_parser().parse_args(args_list)
        args.exec_fn = exec_fn  # a built-in that hands over to an external one uses it
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except CommandError as exc:
        _fail(str(exc))
        return exc.status
    except TokenRelayError as exc:
        _fail(exc.message)
        return 1
    except (ValidationError, SettingsError) as exc:  # e.g. a list variable not JSON
        _fail(settings_problem(exc))
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: still one line, but say what it was
        _fail(f"unexpected {type(exc).__name__}: {exc}")
        return 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the built-in subcommands (external ones are listed too)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Serve LLMs to many clients through Redis, Celery and Flask."
    )
    parser.set_defaults(handler=lambda _: _print_help(parser))
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    model = commands.add_parser("model", help="prepare and list model directories")
    model.set_defaults(handler=lambda _: _print_help(model))
    model_commands = model.add_subparsers(title="model commands", metavar="COMMAND")
    prepare = model_commands.add_parser(
        "prepare", help="build the bundled SmolLM2 model directory (offline, idempotent)"
    )
    _add_models_dir(prepare)
    prepare.set_defaults(handler=_model_prepare)
    add = model_commands.add_parser(
        "add",
        help="bring your own model: a GGUF file (prepared into a model directory, served "
        "as its file's name) or an HF model directory (linked, served as its name)",
    )
    add.add_argument("file", type=Path, help="a .gguf file or a model directory")
    _add_models_dir(add)
    add.set_defaults(handler=_model_add)
    listing = model_commands.add_parser("list", help="list prepared models")
    _add_models_dir(listing)
    listing.add_argument(
        "--served",
        action="store_true",
        help="list the models served on the Redis instead (as `tokenrelay models`)",
    )
    listing.set_defaults(handler=_model_list)

    config = commands.add_parser("config", help="configuration tools")
    config.set_defaults(handler=lambda _: _print_help(config))
    config_commands = config.add_subparsers(title="config commands", metavar="COMMAND")
    docs = config_commands.add_parser(
        "docs", help="print docs/configuration.md, generated from the settings"
    )
    add_docs_options(docs, DEFAULT_DOCS_PATH, "write the file instead of printing")
    docs.set_defaults(handler=_config_docs)

    for name, command in EXTERNAL_COMMANDS.items():
        # Only for --help: main() dispatches these before argparse sees them.
        commands.add_parser(name, help=command.help, add_help=False)
    return parser


def run_external(name: str, args: Sequence[str], *, exec_fn: ExecFn = os.execvp) -> int:
    """Replace this process with ``python -m <module> args`` for an external subcommand.

    Returns only when ``exec_fn`` does (a test's recorder): then 0.
    """
    command = EXTERNAL_COMMANDS[name]
    if not is_runnable_module(command.module):
        raise CommandError(
            f"'{PROG} {name}' is not available: the component {command.module!r} is not "
            "installed (or cannot be run with python -m)"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    exec_fn(sys.executable, [sys.executable, "-m", command.module, *args])
    return 0


def is_runnable_module(module: str) -> bool:
    """Whether ``python -m module`` would find something to run.

    Finding a submodule imports its parent packages; a parent that fails to import
    means the component is not usable either.
    """
    try:
        spec = importlib.util.find_spec(module)
        if spec is None:
            return False
        if spec.submodule_search_locations is not None:  # a package: needs __main__
            return importlib.util.find_spec(f"{module}.__main__") is not None
        return True
    except (ImportError, ValueError):
        return False


def _settings() -> Settings:
    return Settings()


def _add_models_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="directory of model directories (default: TOKENRELAY_MODELS_DIR)",
    )


def _models_dir(args: argparse.Namespace) -> Path:
    given: Path | None = args.models_dir
    return given if given is not None else _settings().models_dir


def _model_prepare(args: argparse.Namespace) -> int:
    from app.prepare import prepare_bundled_model

    directory = prepare_bundled_model(_models_dir(args), progress=_progress)
    print(directory)
    return 0


def _model_add(args: argparse.Namespace) -> int:
    from app.prepare import add_model_directory, prepare_model_file

    if Path(args.file).expanduser().is_dir():
        print(add_model_directory(args.file, _models_dir(args)))
    else:
        print(prepare_model_file(args.file, _models_dir(args), progress=_progress))
    return 0


def _model_list(args: argparse.Namespace) -> int:
    from app.prepare import list_models

    if args.served:
        return run_external("models", ["list"], exec_fn=args.exec_fn)

    models_dir = _models_dir(args)
    cards = list_models(models_dir)
    if not cards:
        _progress(f"no models in {models_dir} (run `{PROG} model prepare`)")
        return 0
    rows = [("NAME", "CONTEXT", "EOS IDS", "PATH")]
    rows += [
        (c.name, str(c.context_length), ",".join(map(str, c.eos_token_ids)), str(c.path))
        for c in cards
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        padded = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*padded, row[-1]]))
    return 0


def add_docs_options(docs: argparse.ArgumentParser, default: Path, write_help: str) -> None:
    """A generated document's options, the same for every ``docs`` command (``config
    docs``, ``metrics docs``): ``--path``, and ``--write`` or ``--check``."""
    docs.add_argument(
        "--path",
        type=Path,
        default=default,
        help="file for --write/--check (default: %(default)s)",
    )
    mode = docs.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=write_help)
    mode.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")


def _config_docs(args: argparse.Namespace) -> int:
    text = settings_markdown()
    path: Path = args.path
    if args.check:
        try:
            current = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if current != text:
            raise CommandError(f"{path} is out of date: run `{PROG} config docs --write`")
        return 0
    if args.write:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from exc
        _progress(f"wrote {path}")
        return 0
    sys.stdout.write(text)
    return 0


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _progress(message: str) -> None:
    # Progress goes to stderr so stdout carries only the result (the directory).
    print(message, file=sys.stderr, flush=True)


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
