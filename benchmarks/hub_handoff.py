"""The output hub's hand-off of one streamer write, alone: no Redis round trip, hot caches.

    python benchmarks/hub_handoff.py [--requests 64] [--steps 3000]

Why: in the paced relay run (``relay.py --stage relay --rate 200``) the web process's
hub hands each line of a streamer's output step entry to its subscription, one after
the other; a line waits for the work on the lines before it (docs/benchmarks-log.md, issue
12 session 20). This times exactly that code, the real ``OutputHub._take_steps`` on an
entry of ``--requests`` plain text chunks, each subscription with a pump (as the SSE
route's, ``web.sse_pump``: entries of plain deltas taken on the hub's thread), and
prints the p10 and p50 of the time until the first line is taken and until the last.
A private redis-server is started only because a hub is built with a client; its
reader thread is stopped, and nothing is read or written during the timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.messages import OutputEvent, OutputKind
from broker.hub import OutputHub, _Follow
from broker.keys import Keys
from broker.outputs import encode_events
from broker.server import RedisServer
from broker.step_lines import step_line
from broker.subscription import Pumped


def measure(requests: int, steps: int) -> dict[str, float]:
    with RedisServer() as server:
        keys = Keys("bench")
        hub = OutputHub(redis.Redis.from_url(server.url), keys)
        hub.stopping.set()  # its reader thread ends at once: _take_steps is called here
        step_key = keys.output_steps("s1")
        rids = [f"{i:032x}" for i in range(requests)]
        taken: list[float] = []

        def pump(_eid: str, events: list[OutputEvent]) -> Pumped:
            if any(ev.kind is not OutputKind.DELTA for ev in events):
                return Pumped.DECLINED
            taken.append(time.perf_counter())
            return Pumped.TAKEN

        for rid in rids:
            sub = hub.subscribe(rid, wake=False)
            sub.reload = False  # as after its first checkpoint: it follows the step stream
            sub.start_pump(pump)
            hub._follow[sub.key] = _Follow(step_key, "0-0", time.monotonic())
        chunk = encode_events([OutputEvent(OutputKind.DELTA, 0, " fox")])
        firsts: list[float] = []
        alls: list[float] = []
        for step in range(1, steps + 1):
            lines = [step_line(keys.output(rid), str(step), step, chunk) for rid in rids]
            entries = [(b"%d-0" % step, {b"c": b"1", b"d": b"\n".join(lines)})]
            taken.clear()
            t0 = time.perf_counter()
            hub._take_steps(step_key, entries, time.monotonic(), [])
            end = time.perf_counter()
            if len(taken) != requests:
                raise RuntimeError(f"step {step}: {len(taken)} of {requests} lines taken")
            firsts.append(taken[0] - t0)
            alls.append(end - t0)
    warm = steps // 10
    firsts, alls = sorted(firsts[warm:]), sorted(alls[warm:])

    def us(values: list[float], q: float) -> float:
        return round(values[int(q * len(values))] * 1e6, 1)

    return {
        "requests": requests,
        "steps": steps,
        "first_line_us_p10": us(firsts, 0.1),
        "first_line_us_p50": us(firsts, 0.5),
        "all_lines_us_p10": us(alls, 0.1),
        "all_lines_us_p50": us(alls, 0.5),
        "line_us_p10": round(us(alls, 0.1) / requests, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    print(json.dumps(measure(args.requests, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
