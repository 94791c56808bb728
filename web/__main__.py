"""``tokenrelay web``: gunicorn serving ``web.app.create_app`` with gthread workers
(``web.head_first.HeadFirstWorker``: gthread that reads each request's head in its event
loop, so a slow client holds no thread until its request is complete).

Why gthread: every open SSE stream or WebSocket holds one thread for its whole life
(it blocks in Redis ``XREAD`` between events, which releases the GIL), and gthread
gives each worker process a fixed pool of real threads with no monkey-patching of
redis-py, Celery or the tokenizer, which gevent would need. The capacity is
``web_workers x web_threads`` concurrent streams (default 2 x 192 = 384, above the
default admission limit ``max_queue`` = 256, so admission answers 429 before the
thread pools fill up). Connections beyond a worker's free threads wait in its queue.
Long streams do not trip gunicorn's ``timeout``: gthread workers heartbeat from their
main loop, not from request threads.

Metrics: several worker processes need prometheus-client's multiprocess mode, which is
chosen when prometheus-client is first imported. This module therefore sets
``PROMETHEUS_MULTIPROC_DIR`` (a fresh temporary directory unless the operator set one;
an operator's directory is emptied at start) before any worker imports the app, and
tells prometheus-client when a worker exits so its live gauges disappear.

The app is built in each worker after the fork (no ``preload_app``): Redis connection
pools and Celery producers must not be shared across processes.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# What a stopping web process gives its handed-over streams to end and its
# non-streaming answers to be written, after drain_s, before gunicorn kills it.
STREAMS_END_S = 3.0


def prepare_multiprocess_dir() -> str:
    """Point prometheus-client at an empty directory shared by all workers."""
    existing = os.environ.get(MULTIPROC_ENV)
    if existing:
        path = Path(existing)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):  # samples of a previous run would be summed in
            stale.unlink()
        return str(path)
    path_str = tempfile.mkdtemp(prefix="tokenrelay-metrics-")
    os.environ[MULTIPROC_ENV] = path_str
    atexit.register(shutil.rmtree, path_str, ignore_errors=True)
    return path_str


# This worker process's sweeper of abandoned streams (``serve``'s app loader sets it).
_abandoned: Any = None


def _worker_exit(_server: Any, _worker: Any) -> None:
    """A gunicorn worker exits: its last spans go out first (``broker.tracing``), and
    it leaves the web processes' registry (``broker.abandon``)."""
    from broker import tracing

    tracing.shutdown()
    if _abandoned is not None:
        with contextlib.suppress(Exception):  # Redis may be gone: the others reap it
            _abandoned.leave()


def _child_exit(_server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def raise_open_files_limit(wanted: int) -> int:
    """Raise this process's soft limit on open files towards ``wanted`` (at most the hard
    limit; the workers inherit it): each held connection is a descriptor, and a default
    soft limit of 1024 would refuse connections long before ``web_max_connections``."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return int(soft)


# Access-log atoms that are a credential (masked) or may carry one in a query string
# (``?api_key=`` on the WebSocket: redacted), whatever access_log_format names.
_SECRET_ATOMS = ("{authorization}i", "{x-api-key}i", "{cookie}i", "{http_authorization}e",
                 "{http_x_api_key}e", "{http_cookie}e")  # fmt: skip
_URI_ATOMS = ("r", "q", "f", "{raw_uri}e", "{query_string}e", "{http_referer}e")


def web_log(log_format: str) -> type[Any]:
    """gunicorn's logger class for ``log_format`` (``Settings.log_format``).

    json: gunicorn's error log (start-up, workers booting and exiting, its errors) and
    access log go to the root logger, which ``app.logs`` writes as JSON lines, the
    app's own loggers too; an access line carries the response's ``x-request-id`` as
    ``request_id``. text: gunicorn's own formats, as always. Either way an access line
    never holds a key: credential headers are masked and query strings redacted."""
    from gunicorn.glogging import Logger

    from app import logs

    class WebLog(Logger):  # type: ignore[misc]
        def setup(self, cfg: Any) -> None:
            super().setup(cfg)
            if log_format == "json":
                logs.configure("web", cfg.loglevel, "json")
                for log in (self.error_log, self.access_log):
                    for handler in list(log.handlers):
                        log.removeHandler(handler)
                    log.propagate = True

        def atoms(self, resp: Any, req: Any, environ: Any, request_time: Any) -> dict[str, Any]:
            atoms: dict[str, Any] = super().atoms(resp, req, environ, request_time)
            for name in _SECRET_ATOMS:
                if name in atoms:
                    atoms[name] = "***"
            for name in _URI_ATOMS:
                if isinstance(atoms.get(name), str):
                    atoms[name] = logs.redact(atoms[name])
            return atoms

        def access(self, resp: Any, req: Any, environ: Any, request_time: Any) -> None:
            if not self.access_log_enabled:
                return
            atoms = self.atoms_wrapper_class(self.atoms(resp, req, environ, request_time))
            request_id = atoms["{x-request-id}o"]
            self.access_log.info(
                self.cfg.access_log_format,
                atoms,
                extra={"request_id": "" if request_id == "-" else request_id},
            )

    return WebLog


def gunicorn_options(settings: Any, *, access_log: bool = False) -> dict[str, Any]:
    """gunicorn's settings for ``settings`` (a ``app.settings.Settings``)."""
    from web.head_first import HeadFirstWorker

    HeadFirstWorker.header_timeout_s = settings.web_header_timeout_s
    HeadFirstWorker.body_timeout_s = settings.web_body_timeout_s
    HeadFirstWorker.drain_s = settings.drain_s
    threads = settings.web_threads
    return {
        "bind": f"{settings.host}:{settings.port}",
        "workers": settings.web_workers,
        "worker_class": HeadFirstWorker,
        "threads": threads,
        # Waiting, kept-alive and streaming sockets all count; threads are not needed
        # for the first two.
        "worker_connections": max(settings.web_max_connections, threads),
        "timeout": 60,
        # SIGTERM: streams end (for their clients to resume elsewhere) after drain_s;
        # gunicorn's own kill comes a little later, for them to be written out.
        "graceful_timeout": math.ceil(settings.drain_s + STREAMS_END_S),  # whole seconds
        "keepalive": 5,
        "accesslog": "-" if access_log else None,
        "errorlog": "-",
        "logger_class": web_log(settings.log_format),
        "child_exit": _child_exit,
        "worker_exit": _worker_exit,
        "proc_name": "tokenrelay-web",
        # gunicorn >= 24 opens a control socket at a fixed path per user, which several
        # servers on one machine (tests, one per model) would fight over.
        "control_socket_disable": True,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenrelay web", description=__doc__.split("\n")[0])
    parser.add_argument("--host", help="address to bind (default: TOKENRELAY_HOST)")
    parser.add_argument("--port", type=int, help="port to bind (default: TOKENRELAY_PORT)")
    parser.add_argument("--workers", type=int, help="worker processes (TOKENRELAY_WEB_WORKERS)")
    parser.add_argument("--threads", type=int, help="threads per worker (TOKENRELAY_WEB_THREADS)")
    parser.add_argument("--access-log", action="store_true", help="log every request to stderr")
    args = parser.parse_args(argv)

    prepare_multiprocess_dir()  # before anything imports prometheus_client

    from app import logs

    overrides: dict[str, Any] = {
        name: value
        for name, value in (
            ("host", args.host),
            ("port", args.port),
            ("web_workers", args.workers),
            ("web_threads", args.threads),
        )
        if value is not None
    }
    settings = logs.settings_or_exit("web", **overrides)
    from broker import tracing

    tracing.check("web")  # here, once: each gunicorn worker starts it (broker.tracing)
    raise_open_files_limit(settings.web_workers * settings.web_max_connections + 256)
    serve(settings, gunicorn_options(settings, access_log=args.access_log))
    return 0


def serve(settings: Any, options: dict[str, Any]) -> None:
    """Run gunicorn with ``options`` serving the app for ``settings`` until it stops."""
    from gunicorn.app.base import BaseApplication

    class WebServer(BaseApplication):  # type: ignore[misc]
        def load_config(self) -> None:
            for key, value in options.items():
                if key in self.cfg.settings:  # older gunicorns lack some settings
                    self.cfg.set(key, value)

        def load(self) -> Any:
            from broker import tracing
            from web.app import create_app
            from web.context import RUNNER

            global _abandoned
            tracing.start("web")  # in each gunicorn worker: the SDK's thread is its own
            app = create_app(settings)
            # Other processes' abandoned streams too: a deploy stops the process that
            # saw their clients go before their grace is up, and one SIGKILLed never
            # counts its clients out (broker.abandon). Its heartbeat is this thread's.
            _abandoned = app.extensions[RUNNER].abandoned
            _abandoned.start_sweeping()
            return app

    WebServer().run()


if __name__ == "__main__":
    sys.exit(main())
