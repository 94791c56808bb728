"""What tracing costs: CPU per token of the whole pipeline with OpenTelemetry tracing on
and off, side by side in one run (issue 45's target: on within 3 % of off).

    python benchmarks/tracing_overhead.py [--concurrency 8] [--requests 32] [--rounds 5]
    python benchmarks/tracing_overhead.py --control    # A/A: neither stack traced
    OTEL_TRACES_SAMPLER=always_off python benchmarks/tracing_overhead.py  # SDK, no spans

Two stacks run at once, each a redis-server, a Celery worker (echo engine at a steady
``--rate`` steps per second, so both see the same cadence), a streamer and a web server
as real processes; one exports every request's trace to a real OTLP/HTTP receiver in
this process (``tests.otlp_receiver``, protobuf decoded: a collector's work, not
counted) as deployed (no ``OTEL_BSP_*``: an export every 15 s, ``broker.tracing``), the
other runs with no ``OTEL_*`` variable. Each round
sends ``--requests`` streamed chat completions to each stack, ``--concurrency`` at a
time per stack, both stacks at once: this machine's CPUs switch between full and half
speed (benchmarks/relay.py's pace probe), which moves CPU time per token by tens of
per cent from one minute to the next, and only load at the same moment sees the same
speed. A round ends ``--settle`` seconds after its last request; rounds follow each
other, so the exports that fall in a round (each process's, every 15 s) are, over the
rounds, as many as the requests cause. Measured per round and stack: the CPU
seconds of its worker, streamer and web processes (gunicorn's workers included) over
the tokens its clients received (from ``usage``). ``--phases`` phases, each on fresh
stacks, the traced stack started first or second in the order on, off, off, on, ...
(whichever stack starts first costs a few per cent more per token, traced or not, and
by how much changes from one pair of stacks to the next: ``--control``); each phase's
ratio on/off is the median of its rounds', and the result is the phases' geometric
mean. Reported too: µs per token on and off (medians, ranges), per process, and spans
exported per request.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.prepare import prepare_bundled_model
from benchmarks.sse_clients import tree_cpu
from tests.otlp_receiver import otlp_receiver
from tests.stack import Stack, full_stack, isolated_settings

# About 250 tokens: what the echo engine repeats back, a typical reply's length.
MESSAGE = " ".join(
    f"sentence {i} of a reply that is about as long as a chat answer." for i in range(20)
)
# The caller's OTEL_* settings for the traced stack (a batch delay, a sampler), or none.
OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)
# Seconds a round counts after its last request, on and off alike (with
# OTEL_BSP_SCHEDULE_DELAY=5000, the SDK's default, the last export falls in them).
EXPORT_WAIT_S = 5.5


@contextmanager
def stack(models_dir: Path, logs: Path, rate: float, otlp: str | None) -> Iterator[Stack]:
    """A stack whose processes export to ``otlp`` (None: tracing off)."""
    saved = {v: os.environ.pop(v, None) for v in OTEL_VARS}
    if otlp:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp
        for v in OTEL_VARS[1:]:  # the caller's, for the traced one
            if (value := saved[v]) is not None:
                os.environ[v] = value
    try:
        settings = isolated_settings(
            "redis://unused", models_dir, echo_tokens_per_second=rate, max_queue=1024
        )
        with full_stack(settings, logs) as running:
            for v, value in saved.items():  # its processes have started: put them back
                os.environ.pop(v, None)
                if value is not None:
                    os.environ[v] = value
            yield running
    finally:
        for v, value in saved.items():
            os.environ.pop(v, None)
            if value is not None:
                os.environ[v] = value


def one_request(base_url: str, model: str) -> int:
    """Stream one chat completion to its end; the completion tokens its usage says."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": MESSAGE}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 512,
    }
    tokens = 0
    with requests.post(f"{base_url}/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for raw in r.iter_lines():
            line = raw.decode()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                usage = json.loads(line[5:]).get("usage")
                if usage:
                    tokens = int(usage["completion_tokens"])
    return tokens


def engine_counts(s: Stack) -> tuple[float, float]:
    """(steps, token ids) the stack's worker has run since it started, from /metrics (its
    last heartbeat): tokens per step says whether both stacks batched alike."""
    text = requests.get(f"{s.base_url}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))

    return total("tokenrelay_worker_steps_total"), total("tokenrelay_worker_tokens_total")


def cpu_of(s: Stack) -> dict[str, float]:
    """CPU seconds so far of each of the stack's processes (gunicorn's workers in web's)."""
    return {name: tree_cpu(p.pid) for name, p in s.procs.items()}


def measure(
    stacks: dict[str, Stack], n: int, concurrency: int, settle_s: float = EXPORT_WAIT_S
) -> dict[str, tuple[dict[str, float], int]]:
    """Per stack, at the same time: (CPU seconds of each of its processes, tokens) for
    ``n`` requests, ``concurrency`` at a time. Both stacks run together, so whatever the
    machine does meanwhile (its CPUs change speed) hits both alike."""
    before = {name: cpu_of(s) for name, s in stacks.items()}
    counts = {name: engine_counts(s) for name, s in stacks.items()}

    def load(s: Stack) -> int:
        with ThreadPoolExecutor(concurrency) as pool:
            model = s.settings.served_name
            return sum(pool.map(lambda _: one_request(s.base_url, model), range(n)))

    with ThreadPoolExecutor(len(stacks)) as both:
        tokens = dict(zip(stacks, both.map(load, stacks.values()), strict=True))
    time.sleep(settle_s)  # the traced stack's exports meanwhile are counted
    out = {}
    for name, s in stacks.items():
        after = cpu_of(s)
        out[name] = ({k: after[k] - before[name][k] for k in after}, tokens[name])
        steps, ids = (b - a for a, b in zip(counts[name], engine_counts(s), strict=True))
        print(f"  {name}: {ids / max(steps, 1):.2f} tokens per engine step ({steps:.0f} steps)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="per stack per round")
    parser.add_argument("--rounds", type=int, default=5, help="per phase")
    parser.add_argument(
        "--phases", type=int, default=2,
        help="pairs of fresh stacks, the traced one started first, second, second, first, ...",
    )  # fmt: skip
    parser.add_argument("--rate", type=float, default=50.0, help="echo steps per second")
    parser.add_argument("--settle", type=float, default=EXPORT_WAIT_S,
                        help="seconds counted after each stack's last request")  # fmt: skip
    parser.add_argument(
        "--control", action="store_true",
        help="an A/A run: the 'on' stack untraced too (what the ratio is with no difference)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)

    models_dir = Path(tempfile.mkdtemp(prefix="tracing-bench-models-"))
    prepare_bundled_model(models_dir)
    logs = Path(tempfile.mkdtemp(prefix="tracing-bench-logs-"))
    per_token: dict[str, list[float]] = {"off": [], "on": []}
    per_process: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    phase_ratios: list[list[float]] = []  # on/off per round, per phase
    spans = 0
    with otlp_receiver() as receiver:
        otlp = None if args.control else receiver.url
        # Phases on fresh stacks, the traced one started first, then second (and so on,
        # in the order on off off on): a stack started first was measured at 0.94-1.06x
        # the other's CPU per token with neither traced (--control), and the phases'
        # geometric mean cancels such a bias.
        orders = [("on", "off", "off", "on")[p % 4] for p in range(args.phases)]
        for phase, first in enumerate(orders):
            with ExitStack() as stack_of:
                started = {}
                for name in (first, "off" if first == "on" else "on"):
                    where = logs / f"{phase}-{name}"
                    url = otlp if name == "on" else None
                    started[name] = stack_of.enter_context(stack(models_dir, where, args.rate, url))
                stacks = {"on": started["on"], "off": started["off"]}
                # Warm up with a whole round, uncounted: the first export and whatever
                # else a process does once (the tracer's set-up, ~0.1 s) fall in it.
                measure(stacks, args.requests, args.concurrency, args.settle)
                spans_before = len(receiver.spans())
                ratios: list[float] = []
                for r in range(args.rounds):
                    got = measure(stacks, args.requests, args.concurrency, args.settle)
                    for name, (cpus, tokens) in got.items():
                        cpu = sum(cpus.values())
                        per_token[name].append(cpu / tokens * 1e6)
                        for proc, c in cpus.items():
                            per_process[name].setdefault(proc, []).append(c / tokens * 1e6)
                        parts = ", ".join(f"{p} {c / tokens * 1e6:.1f}" for p, c in cpus.items())
                        us = per_token[name][-1]
                        print(f"phase {phase + 1} ({first} first) round {r + 1} {name:>3}: "
                              f"{tokens} tokens, {cpu:.2f} CPU s, {us:.1f} µs/token ({parts})",
                              flush=True)  # fmt: skip
                    ratios.append(per_token["on"][-1] / per_token["off"][-1])
                phase_ratios.append(ratios)
                spans += len(receiver.spans()) - spans_before
    med = {k: statistics.median(v) for k, v in per_token.items()}
    result: dict[str, Any] = {
        "concurrency": args.concurrency,
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "us_per_token": {k: round(v, 1) for k, v in med.items()},
        "range": {k: [round(min(v), 1), round(max(v), 1)] for k, v in per_token.items()},
        "us_per_token_by_process": {
            k: {p: round(statistics.median(v), 1) for p, v in procs.items()}
            for k, procs in per_process.items()
        },
        # Per phase, the median of its rounds' ratios; overall, their geometric mean.
        "ratio_by_phase": [
            [f"{first} first", round(statistics.median(r), 4)]
            for first, r in zip(orders, phase_ratios, strict=True)
        ],
        "ratio_on_off": round(
            math.prod(statistics.median(r) for r in phase_ratios) ** (1 / len(phase_ratios)), 4
        ),
        "ratios": [[round(x, 4) for x in r] for r in phase_ratios],
        "spans_per_request": round(spans / (args.phases * args.requests * args.rounds), 2),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
