"""A real Redis Sentinel group for tests: a master, replicas and sentinels, each its own
``redis-server`` process on a free loopback port, stopped (or killed) by the PID we
started. Sentinel timings are shortened so a failover takes seconds, not the default
30 s + 3 min."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from broker.server import dies_with_parent, free_port, redis_executable, redis_server_args
from tests.stack import wait_for

MASTER_NAME = "trmaster"


class Node:
    """One redis-server (data node or sentinel) with its output in a log file."""

    def __init__(self, name: str, port: int, args: list[str], log: Path) -> None:
        self.name = name
        self.port = port
        self.log = log
        self._fh = log.open("wb")
        self.proc = subprocess.Popen(
            args, stdout=self._fh, stderr=subprocess.STDOUT, preexec_fn=dies_with_parent()
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=0.5)

    def kill(self) -> None:
        """SIGKILL by the PID we started: a crash, no goodbye to replicas or clients."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._fh.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


class SentinelGroup:
    """``replicas`` replicas of one master, watched by ``sentinels`` sentinels (quorum 2).

    ``url`` is the ``redis+sentinel://`` URL tokenrelay processes are given.
    """

    def __init__(
        self,
        work_dir: Path,
        *,
        replicas: int = 1,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:
        self.dir = work_dir
        self.n_replicas = replicas
        self.n_sentinels = sentinels
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.master: Node | None = None
        self.replicas: list[Node] = []
        self.sentinels: list[Node] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}/0"

    def nodes(self) -> list[Node]:
        return [n for n in [self.master, *self.replicas, *self.sentinels] if n is not None]

    def _data_node(self, name: str, extra: list[str]) -> Node:
        port = free_port()
        data = self.dir / name
        data.mkdir(parents=True, exist_ok=True)
        return Node(name, port, [*redis_server_args(port, data), *extra], self.dir / f"{name}.log")

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        self.dir.mkdir(parents=True, exist_ok=True)
        master = self._data_node("master", [])
        self.master = master
        wait_for(lambda: self._pings(master), timeout, "the master to answer")
        for i in range(self.n_replicas):
            replica = self._data_node(f"replica{i}", ["--replicaof", "127.0.0.1", str(master.port)])
            self.replicas.append(replica)
        for replica in self.replicas:
            wait_for(
                lambda r=replica: self._replication(r).get("master_link_status") == "up",
                timeout,
                f"{replica.name} to sync with the master",
            )
        for i in range(self.n_sentinels):
            self.sentinels.append(self._sentinel(f"sentinel{i}", master.port))
        for sentinel in self.sentinels:
            wait_for(
                lambda s=sentinel: self._sentinel_sees_all(s),
                timeout,
                f"{sentinel.name} to see the replicas and the other sentinels",
                interval=0.2,
            )
        return self

    def _sentinel(self, name: str, master_port: int) -> Node:
        port = free_port()
        conf = self.dir / f"{name}.conf"  # sentinel rewrites its file: one each, writable
        conf.write_text(
            f"port {port}\n"
            "bind 127.0.0.1\n"
            f'dir "{self.dir}"\n'
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
            f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        return Node(
            name, port, [redis_executable(), str(conf), "--sentinel"], self.dir / f"{name}.log"
        )

    def _pings(self, node: Node) -> bool:
        if not node.alive():
            raise RuntimeError(f"{node.name} exited:\n{node.output()}")
        try:
            with node.client() as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    def _replication(self, node: Node) -> dict[str, object]:
        if not node.alive():
            raise RuntimeError(f"{node.name} exited:\n{node.output()}")
        try:
            with node.client() as c:
                return dict(c.info("replication"))
        except redis.RedisError:
            return {}

    def _sentinel_sees_all(self, sentinel: Node) -> bool:
        if not sentinel.alive():
            raise RuntimeError(f"{sentinel.name} exited:\n{sentinel.output()}")
        try:
            with sentinel.client() as c:
                state = c.sentinel_master(MASTER_NAME)
        except redis.RedisError:
            return False
        return (
            int(state["num-slaves"]) >= self.n_replicas
            and int(state["num-other-sentinels"]) >= self.n_sentinels - 1
        )

    def master_port(self) -> int | None:
        """The master's port as the sentinels' majority reports it (None: no answer)."""
        ports: list[int] = []
        for sentinel in self.sentinels:
            if not sentinel.alive():
                continue
            try:
                with sentinel.client() as c:
                    addr = c.sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.RedisError:
                continue
            if addr:
                ports.append(int(addr[1]))
        if not ports:
            return None
        return max(set(ports), key=ports.count)

    def kill_master(self) -> float:
        """SIGKILL the current master; returns the monotonic time of the kill."""
        port = self.master_port()
        victim = next(n for n in [self.master, *self.replicas] if n and n.port == port)
        victim.kill()
        return time.monotonic()

    def wait_failover(self, old_port: int, timeout: float) -> Node:
        """Wait until the sentinels name a new master that answers as a master."""

        def promoted() -> Node | None:
            port = self.master_port()
            if port is None or port == old_port:
                return None
            node = next(n for n in [self.master, *self.replicas] if n and n.port == port)
            return node if self._replication(node).get("role") == "master" else None

        node = wait_for(promoted, timeout, "the sentinels to fail over", interval=0.1)
        assert isinstance(node, Node)
        return node

    def logs(self) -> str:
        return "\n".join(f"--- {n.name} ---\n{n.output()}" for n in self.nodes())

    def stop(self) -> None:
        for node in reversed(self.nodes()):  # sentinels first: no failover on the way out
            node.stop()

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
