"""Real processes for integration and e2e tests: redis-server, Celery workers, streamers,
the web server, and ``full_stack`` (all of them). Each is started on free loopback ports
and stopped by the PID we started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from app.records import RequestRecord, SamplingParams, StopConditions
from app.settings import Settings
from broker.cluster_server import LocalCluster
from broker.connection import open_redis, redis_client
from broker.keys import Keys
from broker.registry import batcher_registry, streamer_registry, worker_registry
from broker.requests import RequestStore
from broker.server import RedisServer, dies_with_parent

REPO = Path(__file__).resolve().parent.parent


def wait_for(
    cond: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def close_client(client: Any) -> None:
    """Close every connection of a client of ``open_redis`` (a pool's or a cluster's)."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        pool.disconnect()
    else:
        client.close()


def isolated_settings(redis_url: str, models_dir: Path, **overrides: object) -> Settings:
    """Settings isolated per test: own key prefix and model name (so own Celery queues)."""
    tag = uuid.uuid4().hex[:8]
    values: dict[str, object] = {
        "redis_url": redis_url,
        "models_dir": models_dir,
        "key_prefix": f"t{tag}:",
        "served_model_name": f"smollm-{tag}",
        "engine": "echo",
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def make_record(
    settings: Settings,
    prompts: list[list[int]],
    *,
    n: int = 1,
    max_tokens: int = 64,
    deadline_s: float = 60,
    **stop: Any,
) -> RequestRecord:
    """A greedy request record as the web tier would write it (EOS = 2, SmolLM2's)."""
    now = time.time()
    return RequestRecord(
        request_id=uuid.uuid4().hex,
        model=settings.served_name,
        prompts=prompts,
        n=n,
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=max_tokens, eos_token_ids=(2,), **stop),
        created=now,
        deadline=now + deadline_s,
    )


class Proc:
    """A child process with its output in a log file (shown when a test fails)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._fh = log.open("wb")
        self.popen = subprocess.Popen(
            args,
            env=env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
            preexec_fn=dies_with_parent(),  # every spawn here runs on the main thread
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait()

    def kill_group(self) -> None:
        """SIGKILL the process and everything it started (gunicorn's master and workers):
        the group we started it in (``start_new_session``), by its PID, never by name."""
        os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._fh.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def __enter__(self) -> Proc:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def child_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
    env.update(settings.to_env())
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@contextmanager
def registered_process(
    settings: Settings,
    log_dir: Path,
    *,
    module: str,
    kind: str,
    name: str,
    wait: bool = True,
) -> Iterator[Proc]:
    """``python -m <module>`` as a real process; waits until it has registered in the
    ``kind`` registry (worker, streamer, batcher) under its own PID."""
    registries: dict[str, Callable[..., Any]] = {
        "worker": worker_registry,
        "streamer": streamer_registry,
        "batcher": batcher_registry,
    }
    proc = Proc(
        [sys.executable, "-m", module, "--loglevel", "INFO"],
        child_env(settings),
        log_dir / f"{name}-{uuid.uuid4().hex[:4]}.log",
    )
    try:
        if wait:
            client, keys = open_redis(settings, max_connections=4)
            registry = registries[kind](client, keys)

            def registered() -> bool:
                if not proc.alive():
                    raise RuntimeError(f"{name} exited early:\n{proc.output()}")
                return any(m.pid == proc.pid for m in registry.live())

            try:
                wait_for(registered, 60, f"the {kind} to register")
            finally:
                close_client(client)  # else its socket outlives the Redis
        yield proc
    finally:
        proc.stop()


def worker_process(
    settings: Settings, log_dir: Path, *, name: str = "worker", wait: bool = True
) -> AbstractContextManager[Proc]:
    """``tokenrelay worker`` as a real process; waits until it has registered."""
    return registered_process(
        settings, log_dir, module="workers", kind="worker", name=name, wait=wait
    )


def streamer_process(
    settings: Settings, log_dir: Path, *, name: str = "streamer", wait: bool = True
) -> AbstractContextManager[Proc]:
    """``tokenrelay streamer`` as a real process; waits until it has registered."""
    return registered_process(
        settings, log_dir, module="workers.streamer", kind="streamer", name=name, wait=wait
    )


# -- the web tier and the whole stack ------------------------------------------------------


@contextmanager
def web_process(
    settings: Settings, log_dir: Path, *, name: str = "web", wait: bool = True
) -> Iterator[Proc]:
    """``tokenrelay web`` (gunicorn) as a real process on ``settings.host:settings.port``;
    waits until ``/health`` answers. Each process gets its own metrics directory."""
    import requests

    tag = uuid.uuid4().hex[:4]
    metrics_dir = log_dir / f"{name}-{tag}-metrics"
    metrics_dir.mkdir(parents=True, exist_ok=True)
    proc = Proc(
        [sys.executable, "-m", "web"],
        child_env(settings, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)),
        log_dir / f"{name}-{tag}.log",
    )
    base_url = f"http://{settings.host}:{settings.port}"
    try:
        if wait:

            def healthy() -> bool:
                if not proc.alive():
                    raise RuntimeError(f"web server exited early:\n{proc.output()}")
                try:
                    return requests.get(f"{base_url}/health", timeout=2).status_code == 200
                except requests.RequestException:  # refused, or still booting (timeout)
                    return False

            wait_for(healthy, 60, "the web server to answer /health", interval=0.2)
        yield proc
    finally:
        proc.stop()


@dataclass
class Stack:
    """A running stack (``full_stack``): ``base_url`` of its web server, the settings all
    its processes share, their logs' directory, the processes by name, and its private
    redis-server (``server``; None when it runs on ``settings.redis_url``)."""

    base_url: str
    settings: Settings
    log_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    server: RedisServer | None = None
    cluster: LocalCluster | None = None  # token traffic's Redis Cluster (``full_stack``)
    _exit: ExitStack = field(default_factory=ExitStack, repr=False)

    def redis(self) -> redis.Redis:
        """A client of the stack's Redis, closed with the stack at the latest (a client's
        ``close`` leaves its pool's connections open: ``close_client``)."""
        client = open_redis(self.settings)[0]
        self._exit.callback(close_client, client)
        return client

    def logs(self) -> str:
        """The tail of every process's log (for a failing test's message)."""
        return "\n".join(f"--- {n} ---\n{p.output()}" for n, p in self.procs.items())

    def start(self, name: str, process: AbstractContextManager[Proc]) -> Proc:
        """Another process on this stack (``worker_process(stack.settings, stack.log_dir,
        name=...)``, a ``Proc``): listed as ``procs[name]`` (replacing what was there),
        stopped by its PID when the stack ends, before the processes started earlier."""
        proc = self._exit.enter_context(process)
        self.procs[name] = proc
        return proc

    def queued(self) -> int:
        """Interactive requests of the served model waiting in its Celery queue (every
        priority step's list), as the autoscaler's triggers read them."""
        from broker.celery_app import celery_redis_url, priority_lists, queue_name

        client = redis_client(celery_redis_url(self.settings), max_connections=2)
        try:
            lists = priority_lists(queue_name("interactive", self.settings.served_name))
            return sum(int(client.llen(k)) for k in lists)
        finally:
            client.connection_pool.disconnect()

    def admitted(self) -> int:
        """Requests admitted and not finished (the admission set)."""
        client, keys = open_redis(self.settings, max_connections=2)
        try:
            return int(client.zcard(keys.inflight))
        finally:
            close_client(client)

    def callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` when the stack ends, before the processes started earlier stop."""
        self._exit.callback(fn)


def start_model_worker(stack: Stack, model: str, name: str | None = None) -> Proc:
    """A worker of another model on ``stack`` (``tokenrelay worker --model MODEL``: with
    the echo engine any name serves, with the bundled tokenizer), as ``procs[name]``."""
    own = stack.settings.model_copy(update={"model": model, "served_model_name": None})
    return stack.start(name or model, worker_process(own, stack.log_dir, name=name or model))


def web_settings(settings: Settings, **overrides: object) -> Settings:
    """``settings`` on a fresh free port on loopback (for another web process)."""
    from broker.server import free_port

    values: dict[str, object] = {"host": "127.0.0.1", "port": free_port()}
    values.update(overrides)
    return settings.model_copy(update=values)


@contextmanager
def full_stack(
    settings: Settings,
    log_dir: Path,
    *,
    engine: str = "echo",
    start_redis: bool = True,
    redis_server: RedisServer | None = None,
    workers: Sequence[str] = ("worker",),
    streamers: Sequence[str] = ("streamer",),
    batcher: bool = False,
    web: str | None = "web",
    cluster: LocalCluster | None = None,
) -> Iterator[Stack]:
    """redis-server, a worker (``engine``), a streamer and the web server, each its own
    process on free loopback ports; everything else comes from ``settings``. Every
    process is stopped by the PID we started, the last started first.

    ``start_redis=False`` uses ``settings.redis_url`` instead of a private redis-server
    (a Sentinel group's URL, say). ``redis_server``: the private one to start and stop, a
    ``RedisServer`` not yet started (its persistence chosen: ``appendonly=True``); a test
    kills and restarts it as ``stack.server``.

    ``workers`` and ``streamers``: one process per name (``("w1", "w2")`` for two),
    ``batcher=True`` adds the batch driver, ``web=None`` starts no web server (else its
    name); each is ``stack.procs[name]``, started in that order.
    ``cluster``: token traffic on this Redis Cluster (not started yet: started and
    stopped here, as ``stack.cluster``), Celery on the private redis-server.
    Yields a ``Stack``; ``stack.settings`` is what the processes run with.
    """
    with ExitStack() as stack:
        server: RedisServer | None = None
        if cluster is not None:
            server = stack.enter_context(redis_server or RedisServer())
            stack.enter_context(cluster)
            update = {"redis_url": cluster.url, "redis_cluster": "yes", "celery_url": server.url}
            settings = settings.model_copy(update=update)
        elif start_redis:
            server = stack.enter_context(redis_server or RedisServer())
            settings = settings.model_copy(update={"redis_url": server.url})
        settings = web_settings(settings, engine=engine)
        log_dir.mkdir(parents=True, exist_ok=True)
        running = Stack(
            f"http://{settings.host}:{settings.port}", settings, log_dir, server=server, _exit=stack
        )
        running.cluster = cluster
        for name in workers:
            running.start(name, worker_process(settings, log_dir, name=name))
        for name in streamers:
            running.start(name, streamer_process(settings, log_dir, name=name))
        if batcher:
            running.start("batcher", batcher_process(settings, log_dir))
        if web is not None:
            running.start(web, web_process(settings, log_dir, name=web))
        yield running


def in_flight(settings: Settings) -> int:
    """Requests holding an admission slot right now."""
    client, keys = open_redis(settings, max_connections=2)
    try:
        return RequestStore(client, keys).in_flight(time.time())
    finally:
        close_client(client)


@contextmanager
def stack_with(
    models_dir: Path,
    log_dir: Path,
    *,
    engine: str = "echo",
    batcher: bool = False,
    **overrides: object,
) -> Iterator[Stack]:
    """``full_stack`` on settings of its own (``isolated_settings``) with ``overrides``:
    the one line a test module needs for a stack configured its way."""
    settings = isolated_settings("redis://unused", models_dir, **overrides)
    with full_stack(settings, log_dir, engine=engine, batcher=batcher) as running:
        yield running


def flower_process(settings: Settings, log_dir: Path, port: int, auth: str) -> Proc:
    """Flower through ``broker.flower_app``: the Sentinel transport options come with it."""
    return Proc(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "broker.flower_app",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
        ],
        child_env(settings, FLOWER_BASIC_AUTH=auth),
        log_dir / "flower.log",
    )


def batcher_process(
    settings: Settings, log_dir: Path, *, name: str = "batcher", wait: bool = True
) -> AbstractContextManager[Proc]:
    """``tokenrelay batcher`` (the batch driver) as a real process; waits until it has
    registered."""
    return registered_process(
        settings, log_dir, module="workers.batcher", kind="batcher", name=name, wait=wait
    )


def inject_output_chunk(
    client: redis.Redis, keys: Keys, rid: str, payload: bytes, pid: int
) -> None:
    """An output chunk for ``rid`` with ``payload`` as its events, as if the streamer
    (process ``pid``) wrote it: a line of its output step stream with the request's
    next ordinal, which is where a web process reads a flowing stream's chunks from. The
    streamer is paused meanwhile (SIGSTOP), so that it does not write that ordinal first;
    once it goes on, its own chunk with that ordinal is skipped by readers that have it."""
    from broker.outputs import OutputStreams

    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.05)  # a write it had sent is in Redis by now
        log = OutputStreams(client, keys).read_log(rid)
        assert log.steps is not None, "the request's output names no step stream"
        key = keys.output(rid).encode()
        line = b"\n".join([key, b"0", b"%d" % (log.last + 1), payload])
        client.xadd(log.steps, {"c": "injected", "d": line}, maxlen=256, approximate=True)
    finally:
        os.kill(pid, signal.SIGCONT)


def busiest(stack: Stack, kind: str, at_least: int) -> Proc:
    """The process of ``kind`` (worker, streamer) on ``stack`` that holds most requests,
    as its heartbeat (every 2 s) says, once they hold ``at_least`` between them."""
    client, keys = open_redis(stack.settings, max_connections=2)

    def load() -> dict[int, int]:
        if kind == "worker":
            return {w.pid: w.active_jobs for w in worker_registry(client, keys).live()}
        return {s.pid: s.active_requests for s in streamer_registry(client, keys).live()}

    try:
        found: Any = wait_for(lambda: sum(load().values()) >= at_least and load(), 10, kind)
    finally:
        close_client(client)
    pid = max(found, key=lambda p: found[p])
    return next(p for p in stack.procs.values() if p.pid == pid)
