"""``tokenrelay up``: the whole stack on one machine, with no Docker and no GPU.

Starts a Redis (a private redis-server, unless ``TOKENRELAY_REDIS_URL``/``--redis-url``
names one), one worker with the default engine and model, one streamer, the batch
driver, the web server and Flower; waits until the web tier says it is ready; prints the
chat page, API and Flower URLs; then supervises.

Supervision rules, and why:

* Every child runs in its own session, so a Ctrl-C at the terminal reaches only this
  supervisor, which stops the children in order (web first, so no new requests arrive;
  Redis last, so the others shut down against a live broker).
* Children are stopped by the PIDs started here (SIGTERM to the child, a grace period,
  then SIGKILL to its process group, which it leads), never by name: other tokenrelay
  processes on the machine are not ours to touch.
* A child that exits on its own is restarted with backoff (``workers.supervise``); one
  that keeps dying (``--max-restarts`` within ``--restart-window``), or exits with a
  status a restart cannot fix, is reported (name, exit status, the tail of its log) and
  brings the rest down with a non-zero exit status: a crash loop that looks healthy is
  worse than a clear failure.
* The private Redis keeps its data in an append-only file under the run directory, so
  stopping and starting ``up`` (or a crash of redis-server) loses no uploaded file,
  batch or queued request; ``--fresh`` starts empty.
* ``--redis-cluster N``: the relay's Redis is a private Redis Cluster (``broker.
  cluster_server``), Celery's a private redis-server. A node that dies is restarted like
  any child; a master back after its replica took its slots rejoins as that one's replica.
* Ports are checked before anything starts (``workers.up_ports``): each a port number,
  one per server, each free. They are probed the way the servers bind them
  (``SO_REUSEADDR``), so a restart right after a run whose connections are still in
  TIME_WAIT works.
* Children also get SIGTERM if this supervisor is killed outright (Linux
  ``PR_SET_PDEATHSIG``), so nothing is orphaned even by ``kill -9``.

``<run-dir>/up.json`` records the children's PIDs (updated on each restart), the URLs
and, at the end, the exit status (tests and scripts read it);
``<run-dir>/logs/<name>.log`` holds each child's output, across its restarts.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any
from urllib.parse import quote

import redis
from pydantic import ValidationError
from pydantic_settings import SettingsError

from app import logs
from app.errors import TokenRelayError
from app.settings import Settings
from broker.cluster_server import LAYOUT_FILE, ClusterError, LocalCluster
from broker.connection import redis_client
from broker.sentinel import redact
from broker.server import port_is_free, redis_server_args
from workers.supervise import GiveUp, Supervisor
from workers.up_models import models_to_serve
from workers.up_options import PROG, Options, UpError, build_parser, load_settings, parse_args
from workers.up_ports import busy, clash, private_redis_port, server_ports

STATE_FILE = "up.json"
REDIS_URL_VAR = "TOKENRELAY_REDIS_URL"
FLOWER_AUTH_FILE = "flower-auth"  # Flower's generated user:password, with log_format json
LOCK_FILE = "up.lock"
REDIS_DIR = "redis"
CLUSTER_DIR = "redis-cluster"
#: Long enough that a node busy on a machine whose cores run a model is not failed over.
CLUSTER_NODE_TIMEOUT_MS = 5000
POLL_S = 0.2
# A stopping child's time beyond drain_s (closing its engine, writing its last frames).
STOP_MARGIN_S = 10.0
#: ``tokenrelay worker`` exits 3 when its engine cannot start (bad model, missing
#: weights): the same command would fail again, so it is not restarted.
WORKER_ENGINE_FAILED = 3

logger = logging.getLogger(__name__)

# Stop phases, in order: the web tier first (no new requests), then what produces work,
# then the streamer (it relays what the worker published last), Redis last.
STOP_PHASES: tuple[tuple[str, ...], ...] = (
    ("web",),
    ("flower", "batcher", "worker"),
    ("streamer",),
    ("redis",),
)


class Interrupted(Exception):
    """A stop signal arrived while starting up."""


def display_host(host: str) -> str:
    """A host to put in a URL: a wildcard bind address is reached through loopback."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def http_status(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """(status, body) of a GET; (0, reason) when nothing answers."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=2) as resp:
            return resp.status, resp.read(2000).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(2000).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def readiness_reason(body: str) -> str:
    """The human reason inside a /ready answer (OpenAI error shape or plain text)."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        data = json.loads(body)
        message = data.get("error", {}).get("message") or data.get("reason") or data.get("status")
        if message:
            return str(message)
    return body.strip()[:200] or "no answer"


def flower_command(port: int) -> list[str]:
    """Flower on loopback, with tokenrelay's Celery app (``broker.flower_app``, built from
    the TOKENRELAY_* environment as in compose): the broker URL, a Sentinel group's
    transport options and the broker retry settings all come from it."""
    celery = [sys.executable, "-m", "celery", "-A", "broker.flower_app"]
    return [*celery, "flower", "--address=127.0.0.1", f"--port={port}"]


def basic_auth_header(credentials: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(credentials.encode()).decode()}


# -- the stack ------------------------------------------------------------------------------


class Stack:
    """The processes of one ``tokenrelay up``; starts, watches and stops them."""

    def __init__(self, settings: Settings, options: Options, stop: threading.Event) -> None:
        self.settings = settings
        self.options = options
        self.stop_requested = stop
        self.force = threading.Event()
        self.log_dir = options.run_dir / "logs"
        self.supervisor = Supervisor(self.log_dir, options.restart, say, self.write_state)
        self.urls: dict[str, str] = {}
        self.flower_auth = settings.flower_basic_auth or f"admin:{secrets.token_urlsafe(12)}"
        self.state = "starting"
        self.redis_names = ["redis"]  # with --redis-cluster, every node's too
        self.cluster: LocalCluster | None = None
        # "worker", then "worker-2" ... with ``--workers``; then each other model's.
        self.worker_names = ["worker"] + [f"worker-{i}" for i in range(2, options.workers + 1)]
        self.model_workers: dict[str, str] = {}  # worker name -> the other model it serves
        for model in options.more_models:
            slug = "".join(c if c.isalnum() else "-" for c in Path(model).name)
            for i in range(1, options.workers + 1):
                name = f"worker-{slug}" + ("" if i == 1 else f"-{i}")
                self.worker_names.append(name)
                self.model_workers[name] = model

    # -- start ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start everything and wait for readiness; raises UpError / GiveUp / Interrupted."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.settings = self.settings.model_copy(update=self.start_redis())
        env = self._child_env()
        py = sys.executable
        loglevel = ["--loglevel", "INFO"]
        for name in self.worker_names:
            model = self.model_workers.get(name)
            which = ["--model", model] if model else []
            # Another model is served under its own name, not the default's.
            own = {k: v for k, v in env.items() if k != "TOKENRELAY_SERVED_MODEL_NAME"}
            args = [py, "-m", "workers", *which, *loglevel]
            self._spawn(name, args, own if model else env, WORKER_ENGINE_FAILED)
        self._spawn("streamer", [py, "-m", "workers.streamer", *loglevel], env)
        self._spawn("batcher", [py, "-m", "workers.batcher", *loglevel], env)
        # Its own metrics directory: a restarted web server clears the dead one's samples
        # there (instead of leaving a temporary directory behind after a SIGKILL).
        web_env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(self.options.run_dir / "web-metrics")}
        self._spawn("web", [py, "-m", "web"], web_env)
        flower_env = {**env, "FLOWER_BASIC_AUTH": self.flower_auth}  # not on the command line
        self._spawn("flower", flower_command(self.settings.flower_port), flower_env)

        self.urls = self.service_urls()
        self.write_state()
        web = self.urls["chat"].rstrip("/")
        self._wait_ready(
            [f"{web}/ready?model={quote(m, safe='')}" for m in self.served_models()],
            f"{self.urls['flower']}healthcheck",
        )
        self.state = "running"
        self.write_state()
        self._say_ready()

    def service_urls(self) -> dict[str, str]:
        """Where each server answers, as up.json records them.

        Redis's are masked, as in the banner and the logs: up.json is as readable as the
        logs, and none of its readers (tests/upstack.py, benchmarks/peer.py, scripts
        waiting for "running") connects to Redis with them; a private Redis has no
        password, and one given by URL is known to whoever gave it."""
        web = f"http://{display_host(self.settings.host)}:{self.settings.port}"
        urls = {
            "chat": f"{web}/",
            "api": f"{web}/v1",
            "flower": f"http://127.0.0.1:{self.settings.flower_port}/",
            "redis": redact(self.settings.redis_url),
        }
        if self.settings.celery_url:  # Celery's Redis, where it is another
            urls["celery"] = redact(self.settings.celery_url)
        return urls

    def _say_ready(self) -> None:
        """The lines that tell a person where everything is (Flower's password only
        where logs are not JSON: a log line is no place for one)."""
        user, _, password = self.flower_auth.partition(":")
        flower_base = f"127.0.0.1:{self.settings.flower_port}"
        flower = f"http://{user}:{password}@{flower_base}/   (user {user!r}, password {password!r})"
        redis_line = redact(self.settings.redis_url)
        if self.cluster:
            redis_line += f"   (Redis Cluster: {self.cluster.masters} masters, a replica each)"
        if self.settings.celery_url:  # Celery's Redis, where it is another
            redis_line += f"\n  Celery     {redact(self.settings.celery_url)}"
        if logs.json_enabled():  # a log line is no place for a password
            flower = f"http://{flower_base}/   (user {user!r}, password in {self._password_at()})"
        say(
            "ready\n"
            f"  chat page  {self.urls['chat']}\n"
            f"  API base   {self.urls['api']}   (OpenAI-compatible; model "
            f"{', '.join(repr(m) for m in self.served_models())}, engine "
            f"{self.settings.engine})\n"
            f"  Flower     {flower}\n"
            f"  Redis      {redis_line}\n"
            f"  logs       {self.log_dir}/\n"
            "Press Ctrl-C to stop."
        )

    def _password_at(self) -> str:
        """Where Flower's password is to be read: the setting, or a file only its owner
        can read holding the one generated here."""
        if self.settings.flower_basic_auth:
            return "TOKENRELAY_FLOWER_BASIC_AUTH"
        path = self.options.run_dir / FLOWER_AUTH_FILE
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(self.flower_auth + "\n")
        return str(path)

    def served_models(self) -> list[str]:
        """The names clients use: the default model's, then each other model's."""
        return [self.settings.served_name, *(Path(m).name for m in self.options.more_models)]

    def start_redis(self) -> dict[str, str]:
        """The settings saying where Redis is: the URL given (checked), else a private
        redis-server's; with --redis-cluster a private cluster's, and Celery's own."""
        if self.options.redis_cluster:
            celery = self._private_redis()
            return {"redis_url": self._cluster(), "redis_cluster": "yes", "celery_url": celery}
        url = self.options.redis_url or os.environ.get(REDIS_URL_VAR)
        if url:
            try:
                client = redis_client(url, max_connections=2, socket_timeout=3)
                with contextlib.closing(client):
                    client.ping()
            except (redis.RedisError, ValueError) as exc:  # ValueError: a malformed URL
                raise UpError(f"cannot reach Redis at {redact(url)}: {exc}") from exc
            say(f"using Redis at {redact(url)}")
            return {"redis_url": url}
        return {"redis_url": self._private_redis()}

    def _private_redis(self) -> str:
        port = self.options.redis_port
        if port is None:
            port = private_redis_port({self.settings.port, self.settings.flower_port})
        elif not port_is_free("127.0.0.1", port):
            raise UpError(f"port {port} for Redis is in use; choose another with --redis-port")
        data_dir = self.options.run_dir / REDIS_DIR
        if self.options.fresh and data_dir.exists():
            say(f"--fresh: emptying {data_dir}/")
            shutil.rmtree(data_dir)
        elif any(data_dir.glob("appendonly*")):
            say(f"Redis keeps the data of earlier runs in {data_dir}/ (--fresh starts empty)")
        data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
        args = redis_server_args(
            port, data_dir, appendonly=True, maxmemory=self.settings.redis_maxmemory
        )
        self._spawn("redis", args, env)
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url, socket_connect_timeout=0.2)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:  # also BusyLoadingError while it replays its AOF
                return False

        try:
            self._wait_for(answers, 60, "redis-server to answer")
        finally:
            client.close()
        return url

    def _cluster(self) -> str:
        """Start the private Redis Cluster (again, where the run directory holds one)."""
        data_dir = self.options.run_dir / CLUSTER_DIR
        if self.options.fresh and data_dir.exists():
            say(f"--fresh: emptying {data_dir}/")
            shutil.rmtree(data_dir)
        elif (data_dir / LAYOUT_FILE).exists():
            say(f"the cluster keeps the data of earlier runs in {data_dir}/ (--fresh starts empty)")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}

        def launch(name: str, args: list[str]) -> None:
            self.redis_names.append(name)
            self._spawn(name, args, env)

        self.cluster = LocalCluster(
            self.options.redis_cluster,
            data_dir=data_dir,
            node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS,
            appendonly=True,
            maxmemory=self.settings.redis_maxmemory,
            launch=launch,
            wait=self._wait_for,
        )
        try:
            self.cluster.start(timeout=60)
        except ClusterError as exc:
            raise UpError(f"{exc} (--fresh starts a new cluster)") from exc
        return self.cluster.url

    def _child_env(self) -> dict[str, str]:
        """The environment of every child: ours, with the TOKENRELAY_* set replaced."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
        env.update(self.settings.to_env())
        env["PYTHONUNBUFFERED"] = "1"  # logs reach the files as they happen
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str], *fatal: int) -> None:
        if self.stop_requested.is_set():
            raise Interrupted
        # By default each process drains as under Kubernetes or compose: drain_s, and
        # a margin for closing its engine, before it is killed.
        stop_s = self.options.stop_timeout
        if stop_s is None:
            stop_s = self.settings.drain_s + STOP_MARGIN_S
        self.supervisor.start(name, args, env, stop_s, fatal)

    def _wait_ready(self, ready_urls: list[str], flower_url: str) -> None:
        reason = "no answer yet"
        auth = basic_auth_header(self.flower_auth)

        def web_ready() -> bool:
            nonlocal reason
            for url in ready_urls:  # every model served
                status, body = http_status(url)
                if status != 200:
                    reason = (
                        readiness_reason(body) if status else "the web server is not answering yet"
                    )
                    return False
            return True

        def flower_ready() -> bool:
            status, _ = http_status(flower_url, auth)
            return status == 200

        say(f"starting (logs in {self.log_dir}/) ...")
        try:
            self._wait_for(web_ready, self.options.ready_timeout, "the web server to be ready")
        except TimeoutError as exc:
            raise UpError(f"{exc} (last answer: {reason})") from exc
        self._wait_for(flower_ready, 30, "Flower to answer")

    def _wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``cond`` while supervising the children and watching the stop flag."""
        deadline = time.monotonic() + timeout
        while not cond():
            self.supervisor.poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
            if self.stop_requested.wait(0.3):
                raise Interrupted

    # -- run --------------------------------------------------------------------------------
    def watch(self) -> None:
        """Restart children that die until a stop signal; raises GiveUp on a crash loop."""
        while not self.stop_requested.wait(POLL_S):
            self.supervisor.poll()

    # -- stop -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every child, phase by phase; SIGKILL what outlives its grace period."""
        self.state = "stopping"
        self.write_state()
        # Every worker where STOP_PHASES names "worker", every cluster node with "redis".
        groups = {"worker": self.worker_names, "redis": self.redis_names}
        phases = [
            tuple(n for name in phase for n in groups.get(name, [name])) for phase in STOP_PHASES
        ]
        self.supervisor.stop(phases, self.force.is_set, say)
        self.state = "stopped"

    def write_state(self, exit_code: int | None = None) -> None:
        """Record PIDs and URLs in up.json (atomically: readers never see half a file)."""
        state: dict[str, Any] = {
            "pid": os.getpid(),
            "state": self.state,
            "run_dir": str(self.options.run_dir.resolve()),
            "children": {
                slot.name: {
                    "pid": slot.child.pid,
                    "log": str(slot.child.log),
                    "args": slot.args[:3],
                    "restarts": slot.restarts,
                    "last_exit": slot.last_exit,
                }
                for slot in self.supervisor.slots.values()
            },
            "urls": self.urls,
            "exit_code": exit_code,
        }
        path = self.options.run_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)


# -- entry point ----------------------------------------------------------------------------


def say(message: str) -> None:
    """One of up's own messages: a line on stdout, or with log_format json a log line."""
    if logs.json_enabled():
        logger.info("%s", message)
    else:
        print(f"{PROG}: {message}", flush=True)


def fail(message: str) -> None:
    """An error of up's own: on stderr, or with log_format json a log line."""
    if logs.json_enabled():
        logger.error("%s", message)
    else:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def redis_hint(data_dir: Path) -> str:
    """What to do when the private Redis cannot start: most often a damaged AOF."""
    aof = data_dir / "appendonly.aof"
    repair = (
        f"repair it with `redis-check-aof --fix {aof}`, or "
        if shutil.which("redis-check-aof")
        else f"move {aof} aside, or "
    )
    return (
        "if the Redis log says its append-only file is damaged (e.g. after a crash of the "
        f"machine), {repair}start empty with --fresh"
    )


def acquire_run_dir(run_dir: Path) -> IO[str]:
    """Lock the run directory: two ``up``s sharing logs and up.json would confuse both."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = (run_dir / LOCK_FILE).open("a+", encoding="utf-8")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UpError(
            f"another `tokenrelay up` is using {run_dir} (see {run_dir / STATE_FILE}); "
            "stop it or pass --run-dir"
        ) from None
    return lock


def main(argv: Sequence[str] | None = None) -> int:
    args, options = parse_args(argv)
    stop = threading.Event()
    interrupts = 0
    stack: Stack | None = None

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal interrupts
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1 and stack is not None:  # a second Ctrl-C: don't wait
                stack.force.set()
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)

    try:
        settings = load_settings(args)
        if settings.log_format == "json":  # else up's own lines stay plain text
            logs.configure("up", "INFO", "json")
        logs.warn_unknown_variables("up", settings.log_format)  # each child's log says so too
        ours = options.redis_cluster or not (options.redis_url or os.environ.get(REDIS_URL_VAR))
        ports = server_ports(settings, options.redis_port if ours else None)
        if problem := clash(ports):
            build_parser().error(problem)  # exits 2, as any other bad option
        lock = acquire_run_dir(args.run_dir)
        if problem := busy(ports):  # before anything starts: nothing to stop, no up.json
            raise UpError(problem)
        models = models_to_serve(settings, options.more_models, say)
        settings = settings.model_copy(update={"model": models[0]})
        options = dataclasses.replace(options, more_models=tuple(models[1:]))
    except (ValidationError, SettingsError) as exc:
        logs.report_settings_problem("up", exc, fmt=args.log_format)  # --log-format wins
        return 2
    except (UpError, TokenRelayError) as exc:
        fail(str(exc))
        return 1

    stack = Stack(settings, options, stop)
    code = 0
    with lock:
        try:
            stack.start()
            stack.watch()
        except Interrupted:
            pass
        except (UpError, GiveUp, TimeoutError) as exc:
            fail(str(exc))
            if isinstance(exc, GiveUp) and exc.slot.name in stack.redis_names:
                node = f"{CLUSTER_DIR}/{exc.slot.name.removeprefix('redis-')}"  # node-2
                say(redis_hint(options.run_dir / {"redis": REDIS_DIR}.get(exc.slot.name, node)))
            code = 1
        if stack.supervisor.slots:  # else it failed before starting anything
            say("stopping everything it started ...")
            stack.stop()
            stack.write_state(exit_code=code)
            say("stopped" if code == 0 else f"stopped (exit status {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
