"""Two llama.cpp workers: a conversation's next turn goes to the worker holding its
prefix, and when that worker dies, runs cold on the other.

The bundled model through the whole stack (``broker.prefix_routes``). Two conversations
share a system prompt longer than a routing block; their first turns run at the same
time, one per worker (one slot each). Each second turn must be routed to the worker
that ran its first turn and reuse everything that turn left (without routing, the
shared queue would send it to either). Then the worker holding conversation A is
SIGKILLed right before A's third turn: the turn is routed to the dead worker (its
registration still looks fresh), and the streamers' watchdog must send it to the other
worker as soon as the dead one leaves the registry, long before ``requeue_after_s``.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from app.records import RequestRecord
from broker.keys import Keys
from broker.registry import worker_registry
from tests.stack import full_stack, isolated_settings, worker_process

pytest.importorskip("llama_cpp")

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SYSTEM = (
    "You are a patient assistant for a small public library. You answer questions about "
    "opening hours, borrowing rules, late fees, the reading room, children's events and "
    "the book club. Keep every answer to one short sentence, be friendly, and never "
    "invent rules that were not given to you. If you do not know, say so politely."
)
OPENERS = {
    "a": "How many books can I borrow at once with a standard adult library card?",
    "b": "Is there a quiet room where I can study on weekday evenings after work?",
}


def chat(base: str, model: str, messages: list[dict[str, str]]) -> Any:
    body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}
    with requests.post(f"{base}/v1/chat/completions", json=body, timeout=240) as resp:
        assert resp.status_code == 200, resp.text
        return resp.json()


def cached(answer: Any) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def route_of(client: Any, keys: Keys, answer: Any) -> str:
    rid = answer["id"].removeprefix("chatcmpl-")
    return RequestRecord.decode(client.hget(keys.request(rid), "body")).route


def then(messages: list[dict[str, str]], answer: Any, user: str) -> list[dict[str, str]]:
    reply = answer["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": user}]


@pytest.mark.timeout(420)
def test_turns_follow_their_prefix_and_survive_its_worker(models_dir: Path, tmp_path: Path) -> None:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        worker_slots=1,
        llamacpp_threads=1,
        lease_ttl_s=2.0,
        requeue_after_s=300.0,  # only the dead-route path may resend within the test
    )
    with full_stack(settings, tmp_path / "logs", engine="llamacpp") as stack:
        base, model = stack.base_url, stack.settings.served_name
        client, keys = stack.redis(), Keys(stack.settings.key_prefix)
        with worker_process(stack.settings, stack.log_dir, name="worker-b") as worker_b:
            talks = {
                k: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                for k, q in OPENERS.items()
            }
            # First turns together: one slot each, so each worker takes one.
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                answers = pool.map(lambda k: chat(base, model, talks[k]), talks)
                firsts = dict(zip(talks, answers, strict=True))
            deadline = time.monotonic() + 10  # the next heartbeats carry the stats
            while True:
                workers = worker_registry(client, keys).live()
                busy = [w for w in workers if w.engine_stats.get("prefix_cache_queries", 0) > 0]
                if len(busy) == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert len(busy) == 2, f"both first turns ran on one worker:\n{stack.logs()}"

            seconds, routes = {}, {}
            for k in talks:
                talks[k] = then(talks[k], firsts[k], "And what if I am late returning them?")
                seconds[k] = chat(base, model, talks[k])
                routes[k] = route_of(client, keys, seconds[k])
                # Everything the first turn left, not just the shared system prompt.
                assert cached(seconds[k]) >= firsts[k]["usage"]["prompt_tokens"] - 1, stack.logs()
            assert routes["a"] and routes["b"] and routes["a"] != routes["b"]
            metrics = requests.get(f"{base}/metrics", timeout=10).text
            line = f'tokenrelay_prefix_routes_total{{model="{model}",outcome="routed"}}'
            assert any(
                x.startswith(line) and float(x.split()[-1]) >= 2 for x in metrics.splitlines()
            )

            # A's worker dies; A's next turn is routed to it and must run on the other.
            dead = routes["a"]
            victim = worker_b if dead in _ids_of(client, keys, worker_b.pid) else None
            (victim or stack.procs["worker"]).kill()
            talks["a"] = then(talks["a"], seconds["a"], "Thanks, and on Sundays?")
            started = time.monotonic()
            third = chat(base, model, talks["a"])
            took = time.monotonic() - started
            assert route_of(client, keys, third) == dead  # the web tier could not know yet
            assert took < 60, f"the routed turn waited {took:.0f} s for a dead worker"
            # Cold: at most the system prompt came from the survivor's cache.
            assert cached(third) < firsts["a"]["usage"]["prompt_tokens"], stack.logs()


def _ids_of(client: Any, keys: Keys, pid: int) -> set[str]:
    return {w.worker_id for w in worker_registry(client, keys).live() if w.pid == pid}
