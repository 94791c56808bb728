"""Memory of every process and of Redis, idle, with many open streams, after their TTL,
and over a soak (issue 12, item 5).

    python benchmarks/memory.py [--streams 200] [--soak-minutes 10] [--soak-streams 20]

One stack of real processes (redis-server, an echo worker, a streamer, ``tokenrelay web``
with 2 workers), the echo engine at 20 tokens/s per stream:

1. RSS of each process (the web server with its gunicorn workers) and Redis
   ``used_memory`` with nothing running;
2. the same with ``--streams`` streamed chats open at once (each ~30 s long), read by as
   many client threads; Redis memory per in-flight request is the difference / streams;
3. Redis ``used_memory`` right after they finished, and after ``stream_ttl_s`` (set to
   91 s here) has expired their records and streams;
4. a soak: ``--soak-streams`` clients that each open a new streamed chat as soon as the
   last ended, for ``--soak-minutes``; RSS sampled every 30 s. "Flat" means the last
   sample is within 10% of the first one taken after a one-minute warm-up.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.prepare import prepare_bundled_model
from tests.stack import Stack, full_stack, isolated_settings

RATE = 20.0
TTL_S = 91  # the least a 60 s request timeout allows (plus its 30 s grace)


def rss_mib(pid: int, *, children: bool = False) -> float:
    """Resident memory of ``pid`` (and its direct children), MiB."""

    def one(status: Path) -> tuple[int, int]:
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        return int(fields["PPid"]), int(fields["VmRSS"].split()[0])

    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid, kib = one(status)
        except (OSError, KeyError, ValueError):
            continue
        if int(status.parent.name) == pid or (children and ppid == pid):
            total += kib
    return round(total / 1024, 1)


def redis_pid(client: redis.Redis) -> int:
    return int(client.info("server")["process_id"])


def snapshot(stack: Stack, client: redis.Redis) -> dict[str, float]:
    """RSS per process and Redis' own accounting, now."""
    out = {name: rss_mib(p.pid, children=name == "web") for name, p in stack.procs.items()}
    out["redis"] = rss_mib(redis_pid(client))
    out["redis_used_mib"] = round(int(client.info("memory")["used_memory"]) / 2**20, 2)
    return out


def key_shapes(client: redis.Redis) -> dict[str, int]:
    """How many keys of each shape (ids replaced by ``*``) Redis holds, with ``(no TTL)``
    appended to the shape of keys that never expire."""
    shapes: dict[str, int] = {}
    for key in client.scan_iter(count=1000):
        name = re.sub(r"[0-9a-f]{8,}[0-9a-f-]*", "*", key.decode(errors="replace"))
        name = re.sub(r"^t[0-9a-f]{4,}", "<prefix>", name)
        if client.ttl(key) == -1:
            name += " (no TTL)"
        shapes[name] = shapes.get(name, 0) + 1
    return dict(sorted(shapes.items()))


class Streams:
    """Client threads that each read streamed chats to ``[DONE]``."""

    def __init__(self, stack: Stack, words: int) -> None:
        self.url = f"{stack.base_url}/v1/chat/completions"
        self.model = stack.settings.served_name
        self.text = " ".join(f"w{i}" for i in range(words))
        self.done = 0
        self.failed = 0
        self.open = 0
        self.seconds: list[float] = []
        self._lock = threading.Lock()

    def one(self) -> None:
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "messages": [{"role": "user", "content": self.text}],
        }
        with self._lock:
            self.open += 1
        started = time.monotonic()
        ok = False
        try:
            with requests.post(self.url, json=body, stream=True, timeout=300) as resp:
                ok = resp.status_code == 200 and any(
                    line == b"data: [DONE]" for line in resp.iter_lines()
                )
        except requests.RequestException:
            ok = False
        with self._lock:
            self.open -= 1
            self.seconds.append(time.monotonic() - started)
            self.done += ok
            self.failed += not ok

    def start(self, count: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.one, daemon=True) for _ in range(count)]
        for t in threads:
            t.start()
        return threads

    def loop(self, count: int, until: float) -> list[threading.Thread]:
        def forever() -> None:
            while time.monotonic() < until:
                self.one()

        threads = [threading.Thread(target=forever, daemon=True) for _ in range(count)]
        for t in threads:
            t.start()
        return threads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--soak-minutes", type=float, default=10.0)
    parser.add_argument("--soak-streams", type=int, default=20)
    parser.add_argument("--models-dir", type=Path)
    args = parser.parse_args()
    models_dir = args.models_dir or Path(tempfile.mkdtemp(prefix="tr-bench-models-"))
    prepare_bundled_model(models_dir, progress=lambda _msg: None)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = isolated_settings(
            "redis://unused",
            models_dir,
            echo_tokens_per_second=RATE,
            worker_slots=args.streams,
            max_queue=args.streams * 2,
            stream_ttl_s=TTL_S,
            request_timeout_s=60,
            web_workers=2,
        )
        with full_stack(settings, Path(tmp)) as stack:
            client = stack.redis()
            time.sleep(3)
            report["idle"] = snapshot(stack, client)

            streams = Streams(stack, words=200)  # ~600 tokens: ~30 s per stream at 20/s
            threads = streams.start(args.streams)
            time.sleep(12)
            report["open_streams"] = {**snapshot(stack, client), "streams_open": streams.open}
            extra = report["open_streams"]["redis_used_mib"] - report["idle"]["redis_used_mib"]
            report["redis_kib_per_inflight_request"] = round(extra * 1024 / args.streams, 1)
            for t in threads:
                t.join()
            report["finished"] = {
                **snapshot(stack, client),
                "ok": streams.done,
                "failed": streams.failed,
                "stream_s_median": round(sorted(streams.seconds)[len(streams.seconds) // 2], 1),
            }
            time.sleep(TTL_S + 3)
            report["after_ttl"] = {**snapshot(stack, client), "keys": key_shapes(client)}

            if args.soak_minutes <= 0:
                print(json.dumps(report, indent=2))
                return 0
            soak = Streams(stack, words=100)  # ~5 s per stream
            started = time.monotonic()
            until = started + args.soak_minutes * 60
            threads = soak.loop(args.soak_streams, until)
            samples: list[dict[str, float]] = []
            while time.monotonic() < until:
                time.sleep(min(30.0, max(0.0, until - time.monotonic())))
                samples.append(
                    {"t_s": round(time.monotonic() - started), **snapshot(stack, client)}
                )
            for t in threads:
                t.join()
            warm = [s for s in samples if s["t_s"] >= 60] or samples
            first, last = warm[0], samples[-1]
            report["soak"] = {
                "minutes": args.soak_minutes,
                "streams": args.soak_streams,
                "completed": soak.done,
                "failed": soak.failed,
                "first_after_warmup": first,
                "last": last,
                "growth_pct": {
                    k: round((last[k] - first[k]) * 100 / first[k], 1)
                    for k in ("web", "worker", "streamer", "redis")
                },
            }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
