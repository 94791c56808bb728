"""The command line of ``tokenrelay up`` and the options it turns into (``workers.up``
runs the stack; this module only parses and validates)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.settings import Settings
from workers.supervise import RestartPolicy
from workers.up_ports import port_number

PROG = "tokenrelay up"


class UpError(Exception):
    """A start-up failure to report in one line (exit status 1)."""


def positive_seconds(text: str) -> float:
    """argparse's ``type`` for a wait that must be able to end in success: a deadline
    already past (0, -5) would fail every start, so argparse refuses it, naming the flag."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return seconds


def grace_seconds(text: str) -> float:
    """argparse's ``type`` for a grace period: 0 (kill at once) is one, -1 is not."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return seconds


@dataclass(frozen=True)
class Options:
    """What ``up`` does beyond the settings it hands to every child."""

    run_dir: Path
    redis_url: str | None
    redis_port: int | None
    ready_timeout: float
    stop_timeout: float | None
    fresh: bool = False
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    workers: int = 1
    # Models served beside the settings' own (``--model`` given more than once), each
    # by workers of its own; the first ``--model`` is the default model.
    more_models: tuple[str, ...] = ()
    # Masters of a private Redis Cluster (each with a replica) for the relay's traffic,
    # beside a private redis-server for Celery; 0: no cluster.
    redis_cluster: int = 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run the whole stack on this machine: Redis, a worker, a streamer, "
        "the batch driver, the web server and Flower. A process that dies is restarted; "
        "Ctrl-C stops everything it started.",
    )
    parser.add_argument(
        "--engine",
        choices=["llamacpp", "exllamav2", "echo"],
        help="engine of the worker (default: TOKENRELAY_ENGINE, llamacpp); "
        "echo needs no model weights",
    )
    parser.add_argument(
        "--model",
        action="append",
        help="model name under models_dir, or a path; repeat it to serve several models "
        "behind the one web tier, each with workers of its own (the first is the default "
        "model; with --engine echo any name serves, with the bundled tokenizer)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes (each loads the model; a chat's next turn goes to the one "
        "holding its prefix); give each a share of the cores with "
        "TOKENRELAY_LLAMACPP_THREADS (default: %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="what every process logs, up included: human text, or one JSON object a "
        "line (default: TOKENRELAY_LOG_FORMAT, text)",
    )
    parser.add_argument(
        "--port", type=port_number, help="web server port (default: TOKENRELAY_PORT)"
    )
    parser.add_argument(
        "--flower-port", type=port_number, help="Flower port (TOKENRELAY_FLOWER_PORT)"
    )
    parser.add_argument(
        "--redis-url", help="use this Redis instead of starting one (TOKENRELAY_REDIS_URL)"
    )
    parser.add_argument(
        "--redis-port",
        type=port_number,
        help="port of the private redis-server, Celery's with --redis-cluster (default: 6379 "
        "if free, else any free port)",
    )
    parser.add_argument(
        "--redis-cluster",
        type=int,
        default=0,
        metavar="N",
        help="start a private Redis Cluster of N masters (at least 3), each with a replica, "
        "for the relay's traffic, and a private redis-server for Celery (data in "
        "RUN_DIR/redis-cluster/ and RUN_DIR/redis/)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=Path("run"),
        help="logs, Redis data and up.json (default: %(default)s)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="empty the private Redis first (by default it keeps the files, batches and "
        "queued requests of earlier runs, in RUN_DIR/redis/; a private cluster's data is "
        "in RUN_DIR/redis-cluster/)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=positive_seconds,
        default=180.0,
        help="seconds to wait for readiness (default: %(default)s)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=grace_seconds,
        default=None,
        help="seconds each process gets to stop before it is killed (default: "
        "TOKENRELAY_DRAIN_S + 10)",
    )
    default = RestartPolicy()
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=default.max_restarts,
        help="restarts of one process allowed within --restart-window before `up` gives "
        "up and stops everything; 0: stop everything as soon as one dies "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--restart-window",
        type=float,
        default=default.window_s,
        help="seconds over which --max-restarts counts (default: %(default)s)",
    )
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    """Settings from the environment, with the command line's overrides validated."""
    overrides = {
        "engine": args.engine,
        "model": args.model[0] if args.model else None,
        "port": args.port,
        "flower_port": args.flower_port,
        "log_format": args.log_format,
    }
    base = Settings()
    values = {**base.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
    return Settings.model_validate(values)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Options]:
    """The command line, checked (a bad one exits 2, as argparse does)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fresh and (args.redis_url or os.environ.get("TOKENRELAY_REDIS_URL")):
        parser.error("--fresh empties the private Redis only; a Redis given by URL is not ours")
    if args.redis_cluster:
        if args.redis_url or os.environ.get("TOKENRELAY_REDIS_URL"):
            parser.error(
                "--redis-cluster starts a cluster of its own: drop --redis-url and "
                "TOKENRELAY_REDIS_URL"
            )
        if os.environ.get("TOKENRELAY_CELERY_URL"):
            parser.error("--redis-cluster starts Celery's Redis too; unset TOKENRELAY_CELERY_URL")
        if args.redis_cluster < 3:
            parser.error(
                "--redis-cluster needs at least 3 masters: a dead master's replica takes "
                "over only by the vote of a majority of the masters"
            )
    if args.max_restarts < 0 or args.restart_window <= 0:
        parser.error("--max-restarts must be >= 0 and --restart-window > 0")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    # Each model once: a repeat (of the first too) would start a second set of workers
    # for the same model and list it twice.
    models = list(dict.fromkeys(args.model or ()))
    options = Options(
        run_dir=args.run_dir,
        redis_url=args.redis_url,
        redis_port=args.redis_port,
        ready_timeout=args.ready_timeout,
        stop_timeout=args.stop_timeout,
        fresh=args.fresh,
        restart=RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window),
        workers=args.workers,
        more_models=tuple(models[1:]),
        redis_cluster=args.redis_cluster,
    )
    return args, options
