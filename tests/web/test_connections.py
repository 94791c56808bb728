"""One web process holds one Redis connection per open stream: more than redis-py's
default pool of 100 must work (found by benchmarks/sse_clients.py with 200 clients)."""

from __future__ import annotations

import threading

from web.service import GenerationService


def test_more_open_streams_than_the_default_pool(service: GenerationService) -> None:
    streams = 150
    results: list[int] = []
    lock = threading.Lock()

    def reader(i: int) -> None:
        # Each parks a connection in a blocking XREAD, as an open SSE response does.
        got = service.outputs.read(f"nobody-{i}", block_ms=1500)
        with lock:
            results.append(len(got))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [0] * streams
    assert service.redis.connection_pool.max_connections >= streams
