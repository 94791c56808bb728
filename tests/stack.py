"""Real processes for integration tests: redis-server, Celery workers (later: streamers,
web). Each is started on free loopback ports and stopped by the PID we started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from app.settings import Settings
from broker.keys import Keys
from broker.registry import streamer_registry, worker_registry

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


def child_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
    env.update(settings.to_env())
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@contextmanager
def worker_process(
    settings: Settings, log_dir: Path, *, name: str = "worker", wait: bool = True
) -> Iterator[Proc]:
    """``tokenrelay worker`` as a real process; waits until it has registered."""
    proc = Proc(
        [sys.executable, "-m", "workers", "--loglevel", "INFO"],
        child_env(settings),
        log_dir / f"{name}-{uuid.uuid4().hex[:4]}.log",
    )
    try:
        if wait:
            registry = worker_registry(
                redis.Redis.from_url(settings.redis_url), Keys(settings.key_prefix)
            )

            def registered() -> bool:
                if not proc.alive():
                    raise RuntimeError(f"worker exited early:\n{proc.output()}")
                return any(w.pid == proc.pid for w in registry.live())

            wait_for(registered, 60, "the worker to register")
        yield proc
    finally:
        proc.stop()


@contextmanager
def streamer_process(
    settings: Settings, log_dir: Path, *, name: str = "streamer", wait: bool = True
) -> Iterator[Proc]:
    """``tokenrelay streamer`` as a real process; waits until it has registered."""
    proc = Proc(
        [sys.executable, "-m", "workers.streamer", "--loglevel", "INFO"],
        child_env(settings),
        log_dir / f"{name}-{uuid.uuid4().hex[:4]}.log",
    )
    try:
        if wait:
            registry = streamer_registry(
                redis.Redis.from_url(settings.redis_url), Keys(settings.key_prefix)
            )

            def registered() -> bool:
                if not proc.alive():
                    raise RuntimeError(f"streamer exited early:\n{proc.output()}")
                return any(s.pid == proc.pid for s in registry.live())

            wait_for(registered, 60, "the streamer to register")
        yield proc
    finally:
        proc.stop()
