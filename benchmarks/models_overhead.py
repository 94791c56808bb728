"""What serving a second model costs the first: one web tier for one model vs for two.

    python benchmarks/models_overhead.py [--clients 8] [--words 64] [--rate 50] [--rounds 3]

Two stacks side by side in one run (redis-server, streamer, gunicorn, echo workers at
``--rate`` steps/s): ``one`` serves model-a; ``two`` serves model-a and model-b, each by
a worker of its own. Rounds alternate between the stacks; each round sends ``--clients``
concurrent streaming chats and reads them to ``[DONE]``:

- ``one``: every client asks for model-a;
- ``two/a``: the same load, all on model-a, model-b served beside it and idle (the front
  door's cost: model resolution, per-model readiness, the catalog);
- ``two/split``: half the clients on each model (two workers share the load; on a
  2-core machine they also share its cores).

Reports per case TTFT p50 and delivered tokens/s (best round) and the ratio to ``one``
(issue 41's goal: within 5 %). Every text must be exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.prepare import prepare_bundled_model
from benchmarks.relay import percentile
from benchmarks.sse_clients import one_client, run_all
from tests.stack import Stack, full_stack, isolated_settings, start_model_worker


def round_of(stack: Stack, models: list[str], clients: int, words: str) -> dict[str, float]:
    results: list[dict[str, float | str]] = []
    threads = [
        threading.Thread(
            target=one_client,
            args=(stack.base_url, models[i % len(models)], f"{i} {words}", results),
        )
        for i in range(clients)
    ]
    elapsed = run_all(threads)
    ok = [r for r in results if r["ok"] is True]
    if len(ok) != clients:
        errors = sorted({str(r.get("error")) for r in results if r["ok"] is not True})
        raise RuntimeError(f"{clients - len(ok)} of {clients} not exact: {errors[:3]}")
    return {
        "ttft_ms_p50": percentile([float(r["ttft"]) for r in ok], 0.5) * 1000,
        "tokens_per_s": sum(int(r["tokens"]) for r in ok) / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--words", type=int, default=64, help="~3 tokens each, echoed")
    parser.add_argument("--rate", type=float, default=50.0, help="echo steps per second")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models-dir", type=Path)
    args = parser.parse_args()
    models_dir = args.models_dir or Path(tempfile.mkdtemp(prefix="tr-bench-models-"))
    prepare_bundled_model(models_dir)
    words = " ".join(f"w{i}" for i in range(args.words))
    cases = {"one": ["model-a"], "two/a": ["model-a"], "two/split": ["model-a", "model-b"]}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    with ExitStack() as exits, tempfile.TemporaryDirectory() as logs:
        stacks: dict[str, Stack] = {}
        for name, served in (("one", ["model-a"]), ("two", ["model-a", "model-b"])):
            settings = isolated_settings(
                "redis://unused",
                models_dir,
                echo_tokens_per_second=args.rate,
                web_workers=1,
                web_threads=32,
            )
            stack = exits.enter_context(full_stack(settings, Path(logs) / name, workers=()))
            for model in served:
                start_model_worker(stack, model)
            stacks[name] = stack
        round_of(stacks["one"], ["model-a"], args.clients, words)  # warm-up, not counted
        round_of(stacks["two"], ["model-a", "model-b"], args.clients, words)
        for _ in range(args.rounds):
            for case, models in cases.items():
                stack = stacks[case.split("/")[0]]
                rounds[case].append(round_of(stack, models, args.clients, words))
    best = {
        case: {
            "ttft_ms_p50": round(min(r["ttft_ms_p50"] for r in rs), 1),
            "tokens_per_s": round(max(r["tokens_per_s"] for r in rs), 1),
        }
        for case, rs in rounds.items()
    }
    base = best["one"]
    for b in best.values():
        b["ttft_vs_one"] = round(b["ttft_ms_p50"] / base["ttft_ms_p50"], 3)
        b["tokens_per_s_vs_one"] = round(b["tokens_per_s"] / base["tokens_per_s"], 3)
    print(
        json.dumps(
            {
                "clients": args.clients,
                "words": args.words,
                "rate": args.rate,
                "rounds": args.rounds,
                "best": best,
                "all": rounds,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
