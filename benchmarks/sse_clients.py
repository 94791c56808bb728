"""Many concurrent streaming clients through the whole stack (web + streamer + worker).

    python benchmarks/sse_clients.py [--clients 200] [--tokens 128] [--rate 20]

Each client (a thread) sends one streaming chat completion over its own HTTP
connection and reads the SSE stream to ``[DONE]``; the echo engine runs at ``--rate``
steps per second, so every stream stays open for its tokens / rate seconds and all of
them are open at once. ``--tokens`` counts the words of each prompt ("w0 w1 ..."), which
the bundled tokenizer splits into about three tokens each: 128 words echo back as ~403
tokens, ~20 s at the default rate. Reports how many completed with the exact expected
text, delivered tokens/s, time to first token (p50/p99; and, from the usage chunk's
`timings`, how much of it was the queue and the worker's first token) and the web server's
CPU per delivered token.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.prepare import prepare_bundled_model
from benchmarks.relay import cpu_seconds, percentile
from tests.stack import full_stack, isolated_settings


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its live children (gunicorn's workers)."""
    total = cpu_seconds(pid)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            total += cpu_seconds(int(stat.parent.name))
    return total


def run_all(threads: list[threading.Thread]) -> float:
    """Start every client thread at once, wait for all; the seconds that took."""
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def one_client(base_url: str, model: str, text: str, out: list[dict[str, float | str]]) -> None:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "messages": [{"role": "user", "content": text}],
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    got = []
    tokens = 0
    timings: dict[str, float] = {}
    try:
        with requests.post(
            f"{base_url}/v1/chat/completions", json=body, stream=True, timeout=300
        ) as resp:
            for raw in resp.iter_lines():
                line = raw.decode()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message"))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    timings = chunk.get("timings") or {}
                for c in chunk.get("choices", []):
                    piece = c["delta"].get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        got.append(piece)
        out.append(
            {
                "ok": "".join(got) == text,
                "ttft": ttft or 0.0,
                "tokens": tokens,
                "e2e": time.perf_counter() - t0,
                # From the request's arrival at the web tier (the server's clock):
                # until a worker took it, and until its first token left the worker.
                "queue_ms": timings.get("queue_ms") or 0.0,
                "server_ttft_ms": timings.get("ttft_ms") or 0.0,
            }
        )
    except (requests.RequestException, RuntimeError) as exc:
        out.append({"ok": False, "error": str(exc), "ttft": 0.0, "tokens": 0, "e2e": 0.0})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--models-dir", type=Path)
    parser.add_argument("--log-dir", help="keep the processes' logs here")
    parser.add_argument("--web-workers", type=int, default=2, help="gunicorn worker processes")
    args = parser.parse_args()
    models_dir = args.models_dir or Path(tempfile.mkdtemp(prefix="tr-bench-models-"))
    prepare_bundled_model(models_dir)
    words = " ".join(f"w{i}" for i in range(args.tokens))  # ~3 tokens a word (docstring)
    with tempfile.TemporaryDirectory() as tmp:
        logs = args.log_dir or tmp
        settings = isolated_settings(
            "redis://unused",
            models_dir,
            echo_tokens_per_second=args.rate,
            worker_slots=args.clients,
            max_queue=args.clients * 2,
            web_workers=args.web_workers,
        )
        with full_stack(settings, Path(logs)) as stack:
            web_pid = stack.procs["web"].pid
            results: list[dict[str, float | str]] = []
            threads = [
                threading.Thread(
                    target=one_client,
                    args=(stack.base_url, stack.settings.served_name, f"{i} {words}", results),
                )
                for i in range(args.clients)
            ]
            cpu0 = tree_cpu(web_pid)
            elapsed = run_all(threads)
            web_cpu = tree_cpu(web_pid) - cpu0
    ok = [r for r in results if r["ok"] is True]
    delivered = sum(int(r["tokens"]) for r in ok)
    ttfts = [float(r["ttft"]) for r in ok]
    queue_ms = [float(r["queue_ms"]) for r in ok]
    server_ttft_ms = [float(r["server_ttft_ms"]) for r in ok]
    print(
        json.dumps(
            {
                "clients": args.clients,
                "web_workers": args.web_workers,
                "tokens_per_stream": args.tokens,
                "engine_rate": args.rate,
                "completed_exact": len(ok),
                "failed": len(results) - len(ok),
                "elapsed_s": round(elapsed, 2),
                "delivered_tokens_per_s": round(delivered / elapsed),
                "ttft_ms_p50": round(percentile(ttfts, 0.5) * 1000, 1),
                "ttft_ms_p99": round(percentile(ttfts, 0.99) * 1000, 1),
                "queue_ms_p50": round(percentile(queue_ms, 0.5), 1),
                "server_ttft_ms_p50": round(percentile(server_ttft_ms, 0.5), 1),
                "web_cpu_us_per_token": round(web_cpu * 1e6 / max(delivered, 1), 1),
                "errors": sorted({str(r.get("error")) for r in results if "error" in r})[:3],
            },
            indent=2,
        )
    )
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
