"""Relay floor: the latency of the relay's Redis hops alone, with no decoding.

    python benchmarks/relay_floor.py [--requests 8 16 32 64] [--rate 200] [--steps 256]

Why: the paced relay run (``benchmarks/relay.py --stage relay --rate 200 --tokens 256``)
has an added inter-token latency that grows with the requests one engine step carries
(issue 12, item 3). This asks how much of it the design's Redis work and wake-ups set
on this machine, before any Python decoding: three processes do only what the hops
must do, with the production code that builds, packs and sends each call.

- **publisher** (the worker's engine thread): one ``RequestStore.publish_begin`` per
  step for every request, on its direct connection, its reply read after the next
  step, each request's chunks numbered and checkpointed by a ``ChunkLog``, as the
  engine thread does; no engine.
- **relay** (the streamer): a blocking XREAD of the worker's step stream, and for every
  token line one output chunk written with ``OutputStreams.write_then_read`` (the
  fenced output write and the next read in one send), numbered and checkpointed by a
  ``ChunkLog`` per request as the streamer does; its events are made once per
  request, not decoded from the tokens.
- **reader** (a web process's hub): a blocking XREAD of the relay's output step stream;
  each line's latency is the time it was split out of the reply minus the publish
  time (carried in the event's text, since a step line has no other field).

``--variant design`` runs the production scripts. (A ``steps-only`` variant projected
checkpointing the token and then the output streams, broker/chunks.py, by editing
the scripts; both are checkpointed now, and it is gone.) ``--variant hops`` keeps only
the hops:
each process appends one plain step entry (the same lines, no script, no per-request
key) and the next one wakes on it: the latency of three processes handing a step's
lines on through Redis, with nothing else done.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.messages import OutputEvent, OutputKind, TokenDelta
from benchmarks.relay import cpu_seconds, percentile
from broker.chunks import ChunkLog, phase_of
from broker.direct import DirectConnection, xread_command
from broker.keys import Keys
from broker.outputs import OutputEntry, OutputStreams, decode_events, encode_events
from broker.publish import KnownEpoch, PublishItem, encode_deltas, publish_stamp
from broker.requests import RequestStore
from broker.server import RedisServer
from broker.step_lines import split_step

PREFIX = "floor:"
WORKER = "w1"
STREAMER = "s1"


def paced_steps(steps: int, rate: float) -> Iterator[tuple[int, bytes]]:
    """Each step's number and one token's payload, at ``rate`` steps a second (on a
    schedule: a late step does not push the ones after it back)."""
    period = 1.0 / rate
    t_next = time.monotonic()
    for step in range(steps):
        t_next += period
        delay = t_next - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        yield step, encode_deltas([TokenDelta(choice=0, token_ids=[1000 + step])])


def publish_role(url: str, n: int, steps: int, rate: float, variant: str, go: Any) -> None:
    client = redis.Redis.from_url(url)
    keys = Keys(PREFIX)
    store = RequestStore(client, keys)
    client.script_load(store._publish.script)  # as a worker's start does
    via = DirectConnection(client)
    rids = [f"r{i}" for i in range(n)]
    for rid in rids:
        client.set(keys.lease(rid), f"{WORKER}:0", px=600_000)
    go.wait()
    if variant == "hops":
        _publish_hops(via, keys.steps(WORKER), [keys.tokens(r) for r in rids], steps, rate)
        return
    pending = None
    known = KnownEpoch()  # as the engine thread keeps it
    logs = {rid: ChunkLog(phase=phase_of(rid)) for rid in rids}
    for step, payload in paced_steps(steps, rate):
        items = []
        for rid in rids:
            n, mark, prior = logs[rid].stage(payload, step, force=step in (0, steps - 1))
            items.append(
                PublishItem(
                    rid,
                    f"{WORKER}:0",
                    0,
                    payload,
                    first=step == 0,
                    refresh=step % 50 == 0,
                    ordinal=n,
                    checkpoint=mark,
                    prior=prior,
                )
            )
        sent = store.publish_begin(
            items, 600, via, worker_id=WORKER, stamp=publish_stamp(), known=known
        )
        if pending is not None:
            pending.statuses()
        pending = sent
    if pending is not None:
        pending.statuses()


def _publish_hops(
    via: DirectConnection, key: str, streams: list[str], steps: int, rate: float
) -> None:
    """The publisher of ``--variant hops``: one XADD of a step entry, paced."""
    for step, payload in paced_steps(steps, rate):
        lines = b"\n".join(b"%s\n0-1\n%d\n%s" % (s.encode(), step + 1, payload) for s in streams)
        via.call("XADD", key, "MAXLEN", "~", 256, "*", "t", publish_stamp(), "d", lines)


def relay_role(url: str, n: int, steps: int, variant: str) -> None:
    client = redis.Redis.from_url(url)
    keys = Keys(PREFIX)
    outputs = OutputStreams(client, keys)
    outputs.fence_epoch = ""  # the epoch key is unset: no hand-off entry is checked
    client.script_load(outputs._write_script.script)
    via = DirectConnection(client)
    streams = {keys.steps(WORKER): "0-0"}
    first: set[str] = set()
    logs: dict[str, ChunkLog] = {}
    writes = 0
    reply = via.call("XREAD", "COUNT", 64, "BLOCK", 30_000, "STREAMS", *streams, *streams.values())
    lines_left = n * steps
    while lines_left > 0:
        entries: list[OutputEntry] = []
        for _key, step_entries in reply or []:
            for eid, fields in step_entries:
                streams[keys.steps(WORKER)] = eid
                published = fields[b"t"]
                text = published.decode()  # the reader's clock reference
                for tok_key, _attempt, n, _payload in split_step(fields[b"d"]):
                    rid = tok_key.removeprefix(keys.tokens(""))
                    event = OutputEvent(OutputKind.DELTA, choice=0, text=text)
                    log = logs.setdefault(rid, ChunkLog(phase=phase_of(rid)))
                    payload = encode_events([event])
                    force = rid not in first or n == steps
                    o, mark, prior = log.stage(payload, writes, force)
                    entries.append(
                        OutputEntry(
                            rid,
                            [event],
                            str(n),
                            rid not in first,
                            published,
                            n=o,
                            checkpoint=mark,
                            prior=prior,
                            payload=payload,
                        )
                    )
                    first.add(rid)
        writes += 1
        lines_left -= len(entries)
        if variant == "hops":
            lines = b"\n".join(
                b"%s\n0-1\n1\n%s" % (keys.output(e.request_id).encode(), encode_events(e.events))
                for e in entries
            )
            osteps = ("XADD", keys.output_steps(STREAMER), "MAXLEN", "~", 256, "*", "d", lines)
            if lines_left <= 0:
                via.call(*osteps)
                break
            via.send(osteps, xread_command(streams, count=64, block_ms=30_000))
            via.reply("XADD")
            reply = via.reply("XREAD")
            continue
        if lines_left <= 0:
            outputs.write(entries, STREAMER)
            break
        reply = outputs.write_then_read(
            entries,
            STREAMER,
            streams,
            count=64,
            block_ms=30_000,
            on_written=lambda _fenced: None,
            via=via,
        )


def read_role(url: str, n: int, steps: int, out: Any) -> None:
    client = redis.Redis.from_url(url)
    via = DirectConnection(client)
    key = Keys(PREFIX).output_steps(STREAMER)
    cursor = "0-0"
    latencies: list[float] = []
    while len(latencies) < n * steps:
        reply = via.call("XREAD", "COUNT", 64, "BLOCK", 30_000, "STREAMS", key, cursor)
        if not reply:
            break  # the relay stopped: report what arrived
        for _key, entries in reply:
            for eid, fields in entries:
                cursor = eid
                for _out_key, _out_id, _n, events in split_step(fields[b"d"]):
                    recv = time.time()
                    latencies.append(recv - float(decode_events(events)[0].text))
    out.put(latencies)


def run(n: int, steps: int, rate: float, variant: str) -> dict[str, object]:
    ctx = mp.get_context("fork")
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        go = ctx.Event()
        results: Any = ctx.Queue()
        procs = {
            "reader": ctx.Process(target=read_role, args=(server.url, n, steps, results)),
            "relay": ctx.Process(target=relay_role, args=(server.url, n, steps, variant)),
            "publisher": ctx.Process(
                target=publish_role, args=(server.url, n, steps, rate, variant, go)
            ),
        }
        for p in procs.values():
            p.start()
        time.sleep(0.5)  # both readers blocked, the leases set
        pids = {name: p.pid for name, p in procs.items() if p.pid is not None}
        pids["redis"] = server.proc.pid  # type: ignore[union-attr]
        cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
        t0 = time.time()
        go.set()
        latencies: list[float] = results.get(timeout=120)
        elapsed = time.time() - t0
        cpu = {k: cpu_seconds(pid) - cpu0[k] for k, pid in pids.items()}
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
        stats: Any = client.info("commandstats")
        evalsha = stats.get("cmdstat_evalsha", {})
    got = len(latencies)
    return {
        "variant": variant,
        "requests": n,
        "steps": steps,
        "rate": rate,
        "lines": got,
        "elapsed_s": round(elapsed, 3),
        "cpu_us_per_line": {k: round(v * 1e6 / max(got, 1), 1) for k, v in cpu.items()},
        "script_us_per_call": round(evalsha.get("usec_per_call", 0.0), 1),
        "itl_p50_ms": round(percentile(latencies, 0.5) * 1000, 3),
        "itl_p90_ms": round(percentile(latencies, 0.9) * 1000, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--rate", type=float, default=200.0, help="steps per second")
    parser.add_argument(
        "--variant",
        nargs="+",
        choices=["design", "hops"],
        default=["design", "hops"],
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of it all")
    args = parser.parse_args()
    for _ in range(args.rounds):
        for n in args.requests:
            for variant in args.variant:
                print(json.dumps(run(n, args.steps, args.rate, variant)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
