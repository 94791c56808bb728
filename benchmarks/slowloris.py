"""Slowloris against the web tier's worker models, side by side in one run (issue 16).

    python benchmarks/slowloris.py [--slow 1000] [--seconds 20] [--workers 2] [--threads 192]

One stack (redis-server, an echo worker, a streamer); then, for each worker model, a
``tokenrelay web`` on its own port: gunicorn's plain ``gthread`` (what we had),
``head-first`` (``web.head_first.HeadFirstWorker``, what we run) and ``gevent`` (when
the gevent package is installed; gunicorn's gevent worker monkey-patches the process).
Against each: rounds of ordinary clients (``/health``, a chat, a streamed chat, each on
a new connection) with nothing else going on; then ``--slow`` connections that send a
request line and a header, then one more header line every 2 s and never finish, while
the ordinary rounds go on for ``--seconds``. The header timeout is raised to 10 min so
the result shows capacity, not the timeout. Reports per model: the ordinary clients'
median and worst latency idle and under attack, how many were answered within 1 s, how
many failed (5 s timeout), and the web processes' memory under attack.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.slow_clients import Slowloris, normal_clients

MODELS = ("gthread", "head-first", "gevent")


def serve(model: str) -> None:
    """The ``--serve`` child: ``tokenrelay web`` with gunicorn's worker set to ``model``."""
    from app.settings import Settings
    from web.__main__ import (
        gunicorn_options,
        prepare_multiprocess_dir,
        raise_open_files_limit,
    )
    from web.__main__ import (
        serve as run_gunicorn,
    )

    prepare_multiprocess_dir()
    settings = Settings()
    raise_open_files_limit(settings.web_workers * settings.web_max_connections + 256)
    options = gunicorn_options(settings)
    if model == "gthread":
        options["worker_class"] = "gthread"
    elif model == "gevent":
        options["worker_class"] = "gevent"
        options["worker_connections"] = settings.web_max_connections
    run_gunicorn(settings, options)


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (gunicorn's workers), in MiB."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":", 1) for line in status.read_text().splitlines() if ":" in line
            )
        except OSError:
            continue
        if int(status.parent.name) == pid or int(fields["PPid"]) == pid:
            total += int(fields["VmRSS"].split()[0])
    return total / 1024


def summary(latencies: list[float]) -> dict[str, Any]:
    done = [s for s in latencies if math.isfinite(s)]
    return {
        "p50_ms": round(statistics.median(done) * 1000) if done else None,
        "max_ms": round(max(done) * 1000) if done else None,
        "within_1s": f"{sum(1 for s in done if s < 1.0)}/{len(latencies)}",
        "failed": len(latencies) - len(done),
    }


def measure(model: str, stack: Any, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from tests.stack import Proc, child_env, wait_for, web_settings

    settings = web_settings(
        stack.settings,
        web_workers=args.workers,
        web_threads=args.threads,
        web_header_timeout_s=600.0,
    )
    base_url = f"http://{settings.host}:{settings.port}"
    metrics_dir = log_dir / f"metrics-{model}"
    metrics_dir.mkdir()
    proc = Proc(
        [sys.executable, __file__, "--serve", model],
        child_env(settings, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)),
        log_dir / f"web-{model}.log",
    )
    try:
        wait_for(
            lambda: math.isfinite(normal_clients(base_url, settings.served_name)[0][1]),
            60,
            f"the {model} web server",
        )
        model_name = settings.served_name
        idle = [s for _ in range(5) for _, s in normal_clients(base_url, model_name)]
        loris = Slowloris((settings.host, settings.port), args.slow)
        attacked: list[float] = []
        closed = 0
        started = time.monotonic()
        try:
            while time.monotonic() - started < args.seconds:
                closed = max(closed, loris.feed())
                round_started = time.monotonic()
                attacked += [s for _, s in normal_clients(base_url, model_name)]
                time.sleep(max(0.0, 2.0 - (time.monotonic() - round_started)))
            rss = tree_rss_mib(proc.pid)
        finally:
            loris.close()
    finally:
        proc.stop()
    return {
        "model": model,
        "idle": summary(idle),
        "attacked": summary(attacked),
        "slow_closed_by_server": closed,
        "web_rss_mib": round(rss),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--slow", type=int, default=1000, help="slowloris connections")
    parser.add_argument("--seconds", type=float, default=20.0, help="attack duration")
    parser.add_argument("--workers", type=int, default=2, help="web worker processes")
    parser.add_argument("--threads", type=int, default=192, help="threads per web worker")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0

    from app.prepare import prepare_bundled_model
    from tests.stack import full_stack, isolated_settings

    models = args.models.split(",")
    try:
        import gevent  # noqa: F401
    except ImportError:
        if "gevent" in models:
            print("gevent is not installed: skipping it (pip install gevent)")
            models.remove("gevent")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models_dir = root / "models"
        prepare_bundled_model(models_dir, progress=lambda _msg: None)
        settings = isolated_settings("redis://unused", models_dir, max_queue=4096)
        with full_stack(settings, root / "logs") as stack:
            results = [measure(m, stack, args, root / "logs") for m in models]
    print(
        f"{args.slow} slowloris sockets for {args.seconds:g} s; web: {args.workers} workers"
        f" x {args.threads} threads\n"
    )
    print("| worker | idle p50 / max | attacked p50 / max | within 1 s | failed | web RSS |")
    print("|---|---|---|---|---|---|")
    for r in results:
        idle, hit = r["idle"], r["attacked"]
        print(
            f"| {r['model']} | {idle['p50_ms']} / {idle['max_ms']} ms"
            f" | {hit['p50_ms']} / {hit['max_ms']} ms | {hit['within_1s']}"
            f" | {hit['failed']} | {r['web_rss_mib']} MiB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
