"""A connection of one thread's own, for the loops that talk to Redis once per token.

Every call through a redis-py client checks a connection out of the pool (a lock and a
``poll()`` for stale data), records its metrics and runs in the retry wrapper. Measured
on this project's 2-core machine, a blocking XREAD that wakes 100 times a second costs
about 200 µs of CPU per wake through the client and 95 µs on a connection of its own.
The streamer, the web process's output hub and the worker's publish each make one such
call per engine step, so on a stream of one request that overhead is paid per token, by
three processes, on the cores the engine computes on.

``DirectConnection`` is a plain connection made from the client's pool settings (so a
Sentinel client's connection still asks the sentinels for the master), kept by the one
thread that uses it. Errors are the client's own: a reply error (``ResponseError``)
leaves the connection usable; any other error closes it, and the next call reconnects,
so the caller's outage handling works as it does with the client.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import redis
from hiredis import pack_command as _pack_command
from redis.cluster import RedisCluster

from broker.cluster import AWAY, ClusterAway

# A cluster's replies that say the connection's shard is served elsewhere now.
_MOVING = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,
)

# A connection unused this long is checked before it is used again: Redis (its
# ``timeout``) or something on the way may have closed it meanwhile.
STALE_AFTER_S = 5.0


def xread_command(streams: Mapping[Any, Any], *, count: int, block_ms: int | None) -> list[Any]:
    """XREAD's arguments as redis-py's ``xread`` builds them."""
    block = [] if block_ms is None else ["BLOCK", block_ms]
    return ["XREAD", "COUNT", count, *block, "STREAMS", *streams, *streams.values()]


def read_rest(
    via: DirectConnection,
    streams: Mapping[Any, Any],
    reply: Any,
    *,
    count: int,
    quiet: Collection[Any] = (),
) -> Any:
    """``reply`` (a blocking XREAD's) with whatever the streams it left out hold now.

    Redis serves a blocked XREAD with the first of its streams that gets an entry and
    only that one (6.2 and 7.0 alike), even when one script appends to many of them:
    an engine step's publish (one entry per request) wakes a streamer with one
    request's tokens, and a streamer's output write wakes a web process's reader with
    one stream. Left alone, the reader handles that one and reads again for the rest
    (which is already there): two cycles per step, each with its write and its wake-ups
    downstream. So when the reply holds some streams but not all, the others are read
    at once, without blocking, and the step is handled as one.

    ``quiet`` streams (a wake-up or hand-off stream, rarely written together with the
    others) do not call for that read on their own: a reader of one stream plus its
    wake-up key pays no extra round trip per entry."""
    if not reply:
        return reply
    got = {_as_bytes(key) for key, _ in reply}
    rest = {key: cursor for key, cursor in streams.items() if _as_bytes(key) not in got}
    if not any(key not in quiet for key in rest):
        return reply
    more = via.call(*xread_command(rest, count=count, block_ms=None))
    return [*reply, *more] if more else reply


def _as_bytes(key: Any) -> bytes:
    return key if isinstance(key, bytes) else str(key).encode()


def _pack(conn: Any, commands: Sequence[Sequence[Any]]) -> bytes:
    """``commands`` in RESP, as one buffer. hiredis packs a publish of 64 requests (about
    600 arguments) in half the time redis-py's packer takes (it checks each argument's
    type in Python first), and that time is on every token's path, in the worker and
    in the streamer. Arguments hiredis does not take go through redis-py's packer."""
    try:
        return b"".join([_pack_command(tuple(c)) for c in commands])
    except TypeError:
        return b"".join(conn.pack_commands(commands))


class DirectConnection:
    """One connection outside the pool, for a single thread's hot loop."""

    def __init__(self, client: redis.Redis, route: str | None = None) -> None:
        # redis-py's connection layer is untyped.
        self._client: Any = client
        # On a cluster: a key of the shard this connection serves; it connects to the
        # master of that key's slot, found again after a failover (``_node_client``).
        self._route = route
        self._cluster = isinstance(client, RedisCluster)
        if self._cluster and route is None:
            raise ValueError("a direct connection to a cluster needs a route key")
        self._refresh = False  # read the cluster's slot map before connecting again
        self._callbacks: Any = client.response_callbacks if not self._cluster else {}
        self._conn: Any = None
        self._used = 0.0  # monotonic time of the last send
        # Sockets used so far: what was learned from Redis over one (the publish's fence
        # epoch) is trusted only while it is the same.
        self.generation = 0
        self._sock: Any = None

    def send(self, *commands: Sequence[Any]) -> None:
        """Send ``commands`` in one write; read their replies in order with ``reply``."""
        conn = self._connection()
        packed = [_pack(conn, commands)]  # one write: one wake-up of Redis, not one per piece
        try:
            conn.send_packed_command(packed)
        except BaseException:
            self.close()
            self._refresh = self._cluster
            raise

    def reply(self, command: str) -> Any:
        """The next reply, shaped by the client's callback for ``command`` (as the
        client's own call would return it). A reply error is raised as is."""
        conn = self._conn
        if conn is None:
            raise redis.ConnectionError("no reply is due: nothing was sent")
        try:
            response = conn.read_response()
        except redis.ResponseError as exc:
            if self._cluster and isinstance(exc, _MOVING):  # the shard moved: find it again
                self.close()
                self._refresh = True
                raise ClusterAway(f"redis cluster: {exc}") from exc
            raise
        except BaseException:  # a reply may still be on its way: never reuse it
            self.close()
            self._refresh = self._cluster
            raise
        callback = self._callbacks.get(command)
        return callback(response) if callback is not None else response

    def connect(self) -> int:
        """Make sure a connection is open (reconnecting as ``send`` would) and return
        its generation: a caller can tell whether its next send goes over the
        connection it last heard from."""
        self._connection()
        return self.generation

    def call(self, *args: Any) -> Any:
        """One command, one reply."""
        self.send(args)
        return self.reply(str(args[0]).upper())

    def evalsha(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run a registered ``redis.commands.core.Script``, loading it first if Redis
        has lost it (restarted)."""
        self.send_evalsha(script, keys, args)
        return self.evalsha_reply(script, keys, args)

    def send_evalsha(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """The first half of ``evalsha``: send it; ``evalsha_reply`` reads its reply
        later, so the caller can work while Redis runs the script."""
        self.send(("EVALSHA", script.sha, len(keys), *keys, *args))

    def evalsha_reply(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The reply of ``send_evalsha(script, keys, args)``; if Redis had lost the
        script (restarted), it is loaded and run again, now."""
        try:
            return self.reply("EVALSHA")
        except redis.exceptions.NoScriptError:
            self.call("SCRIPT", "LOAD", script.script)
            return self.call("EVALSHA", script.sha, len(keys), *keys, *args)

    def _pool(self) -> Any:
        """The pool whose settings a new connection takes: the client's, or on a
        cluster the pool of the route's master (the slot map read again first when the
        last connection failed or was told its slot moved)."""
        if not self._cluster:
            return self._client.connection_pool
        if self._refresh:
            self._client.refresh()
            self._refresh = False
        try:
            node = self._client.get_node_from_key(self._route)
        except AWAY as exc:
            self._refresh = True
            raise ClusterAway(f"redis cluster: {exc}") from exc
        if node is None or node.redis_connection is None:
            self._refresh = True
            raise ClusterAway(f"redis cluster: no master serves {self._route}")
        self._callbacks = node.redis_connection.response_callbacks
        return node.redis_connection.connection_pool

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.disconnect()
            self._conn = None

    def _connection(self) -> Any:
        now = time.monotonic()
        if self._conn is not None and now - self._used > STALE_AFTER_S:
            # Idle a while: a closed connection reads as readable (EOF), or fails the
            # check. As the pool does, but only after idleness, not on every call.
            try:
                stale = self._conn.can_read()
            except Exception:
                stale = True
            if stale:
                self.close()
        self._used = now
        if self._conn is None:
            pool = self._pool()
            # No health check: it would reconnect inside redis-py, in the middle of a
            # send, unseen by ``generation``.
            conn = pool.connection_class(**{**pool.connection_kwargs, "health_check_interval": 0})
            # Connect explicitly, as the pool does: sending on an unconnected connection
            # would skip a Sentinel connection's own connect() (the master lookup).
            try:
                conn.connect()
            except BaseException:
                self._refresh = self._cluster
                raise
            self._conn = conn
        if self._conn._sock is not self._sock:  # a new socket, however it came about
            self._sock = self._conn._sock
            self.generation += 1
        return self._conn
