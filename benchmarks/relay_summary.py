"""One line per run from the JSON that relay.py and relay_floor.py print.

    python benchmarks/relay_summary.py FILE [FILE ...]

Why: a relay.py run prints a long indented object per stage (every Redis command's
count and cost), a relay_floor.py run one line per variant; a device-machine call
(benchmarks/device_relay.sh) returns only a log's tail, so this boils each run down
to the figures issue 12 asks about: delivered tok/s, CPU µs per token, added ITL
p50 / p99, keep-up and the host's slow share for relay runs, ITL p50 / p90 and CPU
per line for floor runs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def objects(text: str) -> Iterator[dict[str, Any]]:
    """The JSON objects in ``text``, one after another (indented or one per line);
    anything between them that is not JSON (a warning on stderr merged in) is skipped."""
    decoder = json.JSONDecoder()
    i = 0
    while (start := text.find("{", i)) != -1:
        try:
            obj, i = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        if isinstance(obj, dict):
            yield obj


def line(run: dict[str, Any]) -> str | None:
    """A run's figures in one line; None for objects that are not a run."""
    if "variant" in run:  # relay_floor.py
        cpu = run["cpu_us_per_line"]
        return (
            f"floor {run['variant']:<6} {run['requests']:>3} req  {run['rate']:g}/s  "
            f"ITL p50 {run['itl_p50_ms']:.2f} ms  p90 {run['itl_p90_ms']:.2f} ms  "
            f"CPU µs/line {sum(cpu.values()):.1f} "
            f"({', '.join(f'{k} {v:g}' for k, v in cpu.items())})"
        )
    if "keep_up_vs_worker_only" in run:  # relay.py --stage both: the closing summary
        return (
            f"keep-up vs worker-only {run['keep_up_vs_worker_only']} "
            f"(median {run['keep_up_vs_worker_only_median']}), "
            f"in run {run['keep_up_in_run_median']}"
        )
    if "stage" not in run or "tokens_per_s" not in run:
        return None
    streamers = run.get("streamers") or "-"
    reader = run.get("reader") or "-"
    rate = run.get("engine_rate_per_request", "unlimited")
    pace = "max" if rate == "unlimited" else f"{rate:g}/s"
    head = f"{run['stage']:<6} {streamers} str {reader:<5} {pace:>5} {run['tokens_per_s']:>7} tok/s"
    cpu = run.get("cpu_us_per_token", {})
    body = f"  CPU µs/token {run.get('cpu_us_per_token_total', sum(cpu.values())):.1f}"
    if cpu:
        body += f" ({', '.join(f'{k} {v:g}' for k, v in cpu.items())})"
    added = run.get("added_latency_ms")
    if added:
        body += f"  added ITL p50 {added['itl_p50']:.2f} ms  p99 {added['itl_p99']:.2f} ms"
    if "keep_up_in_run" in run:
        body += f"  keep-up in run {run['keep_up_in_run']}"
    share = run.get("host_pace_us", {}).get("in_run", {}).get("slow_share")
    if share:  # the share of the probe's samples that found a CPU at about half speed
        body += f"  slow CPU {share[0]:.0%}"
    return head + body


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().split("\n")[2].strip(), file=sys.stderr)
        return 2
    for name in argv:
        print(f"# {name}")
        path = Path(name)
        if not path.is_file():  # a benchmark that never wrote (its run failed at once)
            print("(no such file)")
            continue
        for run in objects(path.read_text(errors="replace")):
            text = line(run)
            if text is not None:
                print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
