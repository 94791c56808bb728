"""What a worker's per-step publish costs as requests are spread over more hash tags.

    python benchmarks/cluster_publish.py [--requests 64] [--steps 400]

On a Redis Cluster a script's keys must share a slot, so a worker's step (one token
for each of its requests) is one ``PUBLISH`` call per slot its requests are in. Two
designs (docs/scaling.md): requests on a few shard tags chosen at admission (one call
per shard: tokenrelay's), or one slot per request (its own ``{rid}`` tag: one call per
request per step). This measures both, and one Redis's single call, on one redis-server
(the calls are the same on a cluster node; only their number changes): Redis CPU
(``INFO commandstats``, the scripts' µs) and the worker's CPU (this process) per token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.messages import TokenDelta
from app.records import RequestRecord, SamplingParams, StopConditions
from broker.keys import Keys
from broker.publish import PublishItem, PublishLinks, encode_deltas, lease_value
from broker.requests import RequestStore
from broker.server import RedisServer

WORKER = "w1"


def evalsha_usec(client: redis.Redis) -> int:
    stats: Any = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("usec", 0))


def run(client: redis.Redis, shards: int, requests: int, steps: int) -> dict[str, object]:
    keys = Keys(f"b{uuid.uuid4().hex[:6]}:", shards)
    store = RequestStore(client, keys)
    now = time.time()
    rids = [uuid.uuid4().hex for _ in range(requests)]
    for rid in rids:
        store.create(
            RequestRecord(
                request_id=rid,
                model="m",
                prompts=[[1]],
                sampling=SamplingParams(temperature=0.0),
                stop=StopConditions(max_tokens=steps + 1),
                created=now,
                deadline=now + 600,
            )
        )
        store.claim(rid, 0, WORKER, 600.0, now)
    links = PublishLinks.of(client, keys)
    lease = lease_value(WORKER, 0)

    def step(n: int) -> None:
        payload = encode_deltas([TokenDelta(0, [1000 + n])])
        items = [
            PublishItem(
                rid, lease, 0, payload, first=n == 1, refresh=n == 1, ordinal=n, checkpoint=n == 1
            )
            for rid in rids
        ]
        pending = store.publish_shards(items, 600.0, links, WORKER)
        assert all(s == 0 for s in pending.statuses())

    step(1)
    step(2)  # the epoch is known from here on: the steady state
    redis0, cpu0, t0 = evalsha_usec(client), time.process_time(), time.perf_counter()
    for n in range(3, steps + 3):
        step(n)
    elapsed = time.perf_counter() - t0
    tokens = steps * requests
    calls = len({keys.index_of(r) for r in rids}) if shards else 1
    links.close()
    return {
        "design": "one redis (one call)" if not shards else f"{shards} shards",
        "calls_per_step": calls,
        "redis_us_per_token": round((evalsha_usec(client) - redis0) / tokens, 2),
        "worker_us_per_token": round((time.process_time() - cpu0) * 1e6 / tokens, 2),
        "steps_per_s": round(steps / elapsed),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--shards", default="0,3,8,4096", help="0: one Redis's single call")
    args = parser.parse_args()
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        for shards in [int(x) for x in args.shards.split(",")]:
            print(json.dumps(run(client, shards, args.requests, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
