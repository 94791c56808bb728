"""Aggregate tokens/s of the llama.cpp engine: concurrent streams vs one after another.

Run: ``python benchmarks/llamacpp_engine.py [--threads 2] [--tokens 64] [--rounds 2]``
(needs the bundled SmolLM2 GGUF; no downloads). For 1, 4 and 8 streams it runs 8
different chat prompts, greedy, ``--tokens`` new tokens each with EOS ignored:

- concurrent: all N submitted at once to one engine, stepped until done (what a worker
  does with N clients);
- sequential: the same N prompts one after another (what a server that serializes
  streams, like llama-cpp-python's own, can do at best).

It prints generated tokens per second of wall time (prefill included) and the median
time to first token, best of ``--rounds`` runs, both modes interleaved so machine noise
hits them alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.chat_template import PromptBuilder
from app.model_card import load_model_card
from app.prepare import prepare_bundled_model
from app.records import SamplingParams
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.llamacpp import LlamaCppEngine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colours and what they symbolise.",
    "Explain recursion to a child.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "What are the benefits of exercise?",
]


def run(engine: LlamaCppEngine, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """Submit ``prompts`` together and step until done: (tokens/s, median TTFT s)."""
    start = time.perf_counter()
    first: dict[str, float] = {}
    produced = 0
    for i, p in enumerate(prompts):
        engine.submit(EngineJob(f"b{i}", p, [ChoiceJob(0, tokens)], SamplingParams(temperature=0)))
    while engine.has_work():
        for st in engine.step():
            produced += len(st.delta.token_ids)
            if st.delta.token_ids and st.job_id not in first:
                first[st.job_id] = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    return produced / elapsed, statistics.median(first.values())


def sequential(
    engine: LlamaCppEngine, prompts: list[list[int]], tokens: int
) -> tuple[float, float]:
    start = time.perf_counter()
    ttfts = []
    for p in prompts:
        offset = time.perf_counter() - start
        _, ttft = run(engine, [p], tokens)
        ttfts.append(offset + ttft)
    return len(prompts) * tokens / (time.perf_counter() - start), statistics.median(ttfts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        card = load_model_card(prepare_bundled_model(Path(tmp)))
        builder = PromptBuilder.from_card(card)
        prompts = [builder.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        assert card.gguf_file is not None
        engine = LlamaCppEngine(
            card.path / card.gguf_file, n_ctx=4096, n_threads=args.threads, capacity=16
        )
        try:
            run(engine, prompts[:2], 8)  # warm-up
            print(f"{args.tokens} greedy tokens per stream, {args.threads} threads")
            print("| streams | concurrent tok/s | TTFT p50 | sequential tok/s | TTFT p50 | ratio |")
            print("|---|---|---|---|---|---|")
            for n in (1, 4, 8):
                best_c, best_s = (0.0, 0.0), (0.0, 0.0)
                for _ in range(args.rounds):
                    c = run(engine, prompts[:n], args.tokens)
                    s = sequential(engine, prompts[:n], args.tokens)
                    best_c, best_s = max(best_c, c), max(best_s, s)
                print(
                    f"| {n} | {best_c[0]:.0f} | {best_c[1] * 1000:.0f} ms | {best_s[0]:.0f} | "
                    f"{best_s[1] * 1000:.0f} ms | {best_c[0] / best_s[0]:.2f}x |"
                )
        finally:
            engine.close()


if __name__ == "__main__":
    main()
