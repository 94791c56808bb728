"""Fair share between API keys: key A floods, key B sends a few (issue 44).

    python benchmarks/fair_share.py [--flood 200] [--few 10] [--words 12] [--rate 200]
                                    [--slots 4] [--rounds 2]

Two stacks side by side in one run (redis-server, a streamer, gunicorn, one echo worker
with ``--slots`` generation slots at ``--rate`` tokens/s per sequence), the same but for
``TOKENRELAY_FAIR_SHARE``: ``fair`` (on, the default) and ``arrival`` (off: the workers'
queue is served in arrival order). Per stack and round:

- ``alone``: key B sends ``--few`` streamed chats at once, nothing else running;
- ``flooded``: key A sends ``--flood`` streamed chats at once; when they are queued, key
  B sends its ``--few`` the same way.

Reports key B's time to first token (p50, p95) per case and the ratio flooded/alone
(issue 44's goal: within 1.5x with fair share); every text must be exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.prepare import prepare_bundled_model
from benchmarks.relay import percentile
from tests.stack import Stack, full_stack, isolated_settings

KEY_A = "bench-key-a-0123456789"
KEY_B = "bench-key-b-0123456789"


def chat(base: str, key: str, text: str, out: list[dict[str, Any]]) -> None:
    """One streamed chat read to its end: its TTFT and whether its text is exact."""
    t0 = time.perf_counter()
    ttft = None
    got = []
    try:
        with requests.post(
            f"{base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": text}], "stream": True},
            headers={"Authorization": f"Bearer {key}"},
            stream=True,
            timeout=600,
        ) as resp:
            resp.raise_for_status()
            for raw in resp.iter_lines():
                line = raw.decode()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for c in json.loads(line[6:]).get("choices", []):
                    piece = c["delta"].get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        got.append(piece)
        out.append({"ok": "".join(got) == text, "ttft": ttft or 0.0})
    except Exception as exc:  # reported, not raised: the round says how many failed
        out.append({"ok": False, "error": repr(exc), "ttft": 0.0})


def burst(
    base: str, key: str, texts: list[str], out: list[dict[str, Any]]
) -> list[threading.Thread]:
    threads = [threading.Thread(target=chat, args=(base, key, t, out)) for t in texts]
    for t in threads:
        t.start()
    return threads


def b_ttfts(results: list[dict[str, Any]], expected: int) -> list[float]:
    bad = [r for r in results if not r["ok"]]
    if bad or len(results) != expected:
        raise RuntimeError(f"{len(bad)} of {len(results)} not exact: {bad[:2]}")
    return [float(r["ttft"]) for r in results]


def round_of(stack: Stack, args: argparse.Namespace, words: str, n: int) -> dict[str, list[float]]:
    few = [f"b{n}-{i} {words}" for i in range(args.few)]
    alone: list[dict[str, Any]] = []
    for t in burst(stack.base_url, KEY_B, few, alone):
        t.join()
    flood_out: list[dict[str, Any]] = []
    flood = burst(
        stack.base_url, KEY_A, [f"a{n}-{i} {words}" for i in range(args.flood)], flood_out
    )
    # Every one of A's requests admitted (in flight or done): B's arrive behind A's
    # backlog, not behind A's requests still waiting for the web tier to admit them.
    deadline = time.monotonic() + 60
    while stack.admitted() + len(flood_out) < args.flood and time.monotonic() < deadline:
        time.sleep(0.01)
    backlog = stack.queued()
    flooded: list[dict[str, Any]] = []
    for t in burst(stack.base_url, KEY_B, [f"f{x}" for x in few], flooded):
        t.join()
    for t in flood:
        t.join()
    b_ttfts(flood_out, args.flood)
    return {
        "alone": b_ttfts(alone, args.few),
        "flooded": b_ttfts(flooded, args.few),
        "backlog": [float(backlog)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flood", type=int, default=200)
    parser.add_argument("--few", type=int, default=10)
    parser.add_argument("--words", type=int, default=12, help="~2 tokens each, echoed")
    parser.add_argument("--rate", type=float, default=200.0, help="echo tokens/s per sequence")
    parser.add_argument("--slots", type=int, default=4, help="the worker's generation slots")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models-dir", type=Path)
    args = parser.parse_args()
    models_dir = args.models_dir or Path(tempfile.mkdtemp(prefix="tr-bench-models-"))
    prepare_bundled_model(models_dir)
    words = " ".join(f"w{i}" for i in range(args.words))
    report: dict[str, Any] = {
        k: getattr(args, k) for k in ("flood", "few", "words", "rate", "slots", "rounds")
    }
    with ExitStack() as exits, tempfile.TemporaryDirectory() as logs:
        stacks: dict[str, Stack] = {}
        for name, fair in (("fair", True), ("arrival", False)):
            settings = isolated_settings(
                "redis://unused",
                models_dir,
                api_keys=[KEY_A, KEY_B],
                fair_share=fair,
                echo_tokens_per_second=args.rate,
                worker_slots=args.slots,
                max_queue=args.flood + args.few + 16,
                key_max_in_flight=0,
                web_workers=1,
                web_threads=args.flood + args.few + 16,
            )
            stacks[name] = exits.enter_context(full_stack(settings, Path(logs) / name))
        for name, stack in stacks.items():
            runs = [round_of(stack, args, words, n) for n in range(args.rounds + 1)][1:]  # warm-up
            alone = [t for r in runs for t in r["alone"]]
            flooded = [t for r in runs for t in r["flooded"]]
            p95 = (percentile(alone, 0.95), percentile(flooded, 0.95))
            backlog = [int(r["backlog"][0]) for r in runs]
            report[name] = {
                "a_backlog_when_b_sent": backlog,
                "b_alone_ttft_ms": {
                    "p50": round(percentile(alone, 0.5) * 1000, 1),
                    "p95": round(p95[0] * 1000, 1),
                },
                "b_flooded_ttft_ms": {
                    "p50": round(percentile(flooded, 0.5) * 1000, 1),
                    "p95": round(p95[1] * 1000, 1),
                },
                "p95_flooded_vs_alone": round(p95[1] / p95[0], 2),
            }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
