"""The llama.cpp engine through a real Celery worker vs the same engine called directly.

    python benchmarks/worker_overhead.py [--prompts 8] [--tokens 64] [--rounds 2]

Same chat prompts, greedy, in one run (alternating rounds, best of each): tokens/s
directly (submit all, step until done) and through a worker process (records written,
tasks sent, wait until every request is done). Prints both and the ratio (goal >= 0.9),
and whether the greedy token ids were identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.chat_template import PromptBuilder
from app.model_card import load_model_card
from app.prepare import prepare_bundled_model
from app.records import RequestRecord, SamplingParams, StopConditions
from app.settings import Settings
from broker.celery_app import create_celery
from broker.keys import Keys
from broker.publish import decode_deltas
from broker.requests import RequestStore
from broker.server import RedisServer
from tests.stack import isolated_settings, worker_process
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.llamacpp import LlamaCppEngine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is.",
    "List three prime numbers.",
    "How do birds fly?",
    "What is Python used for?",
    "Describe a sunset in one sentence.",
    "Why is the sky blue?",
]


def direct(
    settings: Settings, prompts: list[list[int]], tokens: int
) -> tuple[float, list[list[int]]]:
    card = load_model_card(settings.model_path())
    engine = LlamaCppEngine.from_card(card, settings)
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(
            EngineJob(
                job_id=str(i),
                prompt_ids=p,
                choices=[ChoiceJob(0, tokens)],
                sampling=SamplingParams(temperature=0.0),
                eos_token_ids=frozenset(card.eos_token_ids),
            )
        )
    while engine.has_work():
        for s in engine.step():
            outs[s.job_id] += s.delta.token_ids
    elapsed = time.perf_counter() - t0
    engine.close()
    ids = [outs[str(i)] for i in range(len(prompts))]
    return sum(map(len, ids)) / elapsed, ids


def through_worker(
    settings: Settings, prompts: list[list[int]], tokens: int, store: RequestStore
) -> tuple[float, list[list[int]]]:
    celery_app = create_celery(settings)
    now = time.time()
    records = [
        RequestRecord(
            request_id=uuid.uuid4().hex,
            model=settings.served_name,
            prompts=[p],
            sampling=SamplingParams(temperature=0.0),
            stop=StopConditions(max_tokens=tokens, eos_token_ids=(2,)),
            created=now,
            deadline=now + 600,
        )
        for p in prompts
    ]
    t0 = time.perf_counter()
    for r in records:
        store.submit(r, celery_app)
    # Wait on the token streams (blocking XREAD) for every finish, rather than polling:
    # a polling client would steal CPU from the engine it measures.
    cursors: dict[Any, Any] = {store.keys.tokens(r.request_id): "0-0" for r in records}
    while cursors:
        res: Any = store.redis.xread(cursors, block=1000)
        for key_raw, entries in res or []:
            key = key_raw.decode()
            cursors[key] = entries[-1][0]
            if any(d.finish is not None for _e, f in entries for d in decode_deltas(f[b"d"])):
                del cursors[key]
    elapsed = time.perf_counter() - t0
    ids = [store.progress(r.request_id, 1)[0].token_ids for r in records]
    return sum(map(len, ids)) / elapsed, ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models-dir", type=Path)
    args = parser.parse_args()
    models_dir = args.models_dir or Path(tempfile.mkdtemp(prefix="tr-bench-models-"))
    prepare_bundled_model(models_dir)
    with RedisServer() as server, tempfile.TemporaryDirectory() as logs:
        settings = isolated_settings(
            server.url, models_dir, engine="llamacpp", worker_slots=args.prompts, llamacpp_threads=2
        )
        card = load_model_card(settings.model_path())
        builder = PromptBuilder.from_card(card)
        prompts = [
            builder.encode_chat([{"role": "user", "content": q}])
            for q in (QUESTIONS * 4)[: args.prompts]
        ]
        store = RequestStore(redis.Redis.from_url(server.url), Keys(settings.key_prefix))
        best_direct = best_worker = 0.0
        same = True
        with worker_process(settings, Path(logs)):
            for _ in range(args.rounds):
                d, d_ids = direct(settings, prompts, args.tokens)
                w, w_ids = through_worker(settings, prompts, args.tokens, store)
                best_direct, best_worker = max(best_direct, d), max(best_worker, w)
                same = same and d_ids == w_ids
    print(
        json.dumps(
            {
                "prompts": args.prompts,
                "tokens": args.tokens,
                "rounds": args.rounds,
                "direct_tokens_per_s": round(best_direct, 1),
                "worker_tokens_per_s": round(best_worker, 1),
                "ratio": round(best_worker / best_direct, 3),
                "identical_greedy_ids": same,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
