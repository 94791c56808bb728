"""CPU per request start, per process, through the whole stack (web + streamer + worker).

    python benchmarks/start_cost.py [--requests 600] [--clients 4] [--web-workers 2]

Each client (a thread with a kept-alive connection) sends streaming chat completions
of one token, one after another, so what is measured is almost all start: the web's
intake, tokenizing, admission and Celery send; the worker's task receipt, claim and
first step; the streamer's pick-up; Redis under all three. Prints the CPU each process
spent per request (µs: utime + stime, the web with its gunicorn workers) and their sum.

A burst of streaming clients waits for these starts (``sse_clients.py``: its time to
first token), and on a machine whose cores the processes share, the sum is what that
wait is made of. CPU counts, unlike latencies, hold still from run to run on a noisy
machine, so an A/B of two checkouts shows a change of a few percent.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.prepare import prepare_bundled_model
from benchmarks.relay import cpu_seconds
from benchmarks.sse_clients import run_all, tree_cpu
from broker.server import RedisServer
from tests.stack import full_stack, isolated_settings


def client(base_url: str, model: str, first: int, count: int, words: str) -> None:
    with requests.Session() as session:
        for i in range(first, first + count):
            body: dict[str, Any] = {
                "model": model,
                "stream": True,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": f"{i} {words}"}],
            }
            text = session.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).text
            if "data: [DONE]" not in text or '"error"' in text:
                raise RuntimeError(f"request {i} did not end well: {text[-300:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--web-workers", type=int, default=2)
    parser.add_argument("--words", type=int, default=128, help="words in each prompt")
    parser.add_argument("--models-dir", type=Path)
    args = parser.parse_args()
    models_dir = args.models_dir or Path(tempfile.mkdtemp(prefix="tr-bench-models-"))
    prepare_bundled_model(models_dir)
    words = " ".join(f"w{i}" for i in range(args.words))
    per_client = args.requests // args.clients
    total = per_client * args.clients
    with tempfile.TemporaryDirectory() as logs, RedisServer() as server:
        settings = isolated_settings(
            server.url,
            models_dir,
            echo_tokens_per_second=1000,
            worker_slots=64,
            max_queue=1000,
            web_workers=args.web_workers,
        )
        with full_stack(settings, Path(logs), start_redis=False) as stack:
            model = stack.settings.served_name
            client(stack.base_url, model, 0, 20, words)  # warm: imports, pools, caches
            pids = {name: proc.pid for name, proc in stack.procs.items()}

            def cpu() -> dict[str, float]:
                now = {name: tree_cpu(pid) for name, pid in pids.items()}
                now["redis"] = cpu_seconds(server.proc.pid)  # type: ignore[union-attr]
                return now

            failures: list[Exception] = []

            def one(first: int) -> None:
                try:
                    client(stack.base_url, model, first, per_client, words)
                except Exception as exc:  # reported below; the run does not count
                    failures.append(exc)

            threads = [
                threading.Thread(target=one, args=(1000 + k * per_client,))
                for k in range(args.clients)
            ]
            before = cpu()
            elapsed = run_all(threads)
            after = cpu()
    if failures:
        print(f"{len(failures)} clients failed: {failures[0]}", file=sys.stderr)
        return 1
    per_request = {name: round((after[name] - before[name]) * 1e6 / total) for name in before}
    print(
        json.dumps(
            {
                "requests": total,
                "clients": args.clients,
                "web_workers": args.web_workers,
                "cpu_us_per_request": per_request,
                "cpu_us_per_request_total": sum(per_request.values()),
                "requests_per_s": round(total / elapsed, 1),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
