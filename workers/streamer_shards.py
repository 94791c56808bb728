"""A streamer process on a Redis Cluster: one relay loop per shard.

A ``Streamer`` reads its requests' step streams and its hand-off stream with one
blocking XREAD, which a cluster serves only for keys of one slot, and those of one
shard share one (``broker.keys``). So on a cluster a streamer process runs one
``Streamer`` per shard, each bound to its shard's keys and reading from that shard's
master, in a thread of its own, under one consumer name.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.streamer import Streamer


class ShardedStreamer:
    """A streamer process on a Redis Cluster: one ``Streamer`` loop per shard, each in
    a thread of its own (its reads block on its shard's master), under one name."""

    def __init__(self, loops: list[Streamer]) -> None:
        self.loops = loops
        self.stopping = threading.Event()

    def run(self) -> None:
        threads = [
            threading.Thread(target=loop.run, name=f"streamer-shard-{i}", daemon=True)
            for i, loop in enumerate(self.loops)
        ]
        for t in threads:
            t.start()
        while not self.stopping.wait(0.2):
            if not any(t.is_alive() for t in threads):
                return
        for loop in self.loops:
            loop.stopping.set()
        for t in threads:
            t.join()
