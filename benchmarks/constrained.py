"""Per-step cost of constrained decoding in the llama.cpp engine, at batch 8.

Run: ``python benchmarks/constrained.py [--threads 2] [--tokens 128] [--rounds 3]``
(needs the bundled SmolLM2 GGUF; no downloads). Each round runs the same 8 chat prompts
twice on one engine, interleaved so machine noise hits both alike:

- unconstrained: 8 choices, temperature 0.8, seeded, EOS ignored;
- constrained: the same, each choice under a JSON schema (an object whose first field
  is a string of at least 200 characters, so that all 8 choices stay in the grammar
  for most of their budget instead of completing early).

It times every ``step()`` during which all 8 sequences were decoding (no prompt
prefill in the step, all 8 sampled) and reports the median step time of each mode, the
difference, and the time spent in the grammar itself (token mask, applying it to the
logits, feeding the sampled token back), measured around those calls. The last figure
is the robust one on a shared machine: it is measured inside the very steps it is
compared with, while the two medians come from different moments.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.chat_template import PromptBuilder
from app.model_card import load_model_card
from app.prepare import prepare_bundled_model
from app.records import OutputConstraint, SamplingParams
from workers.engines import constraint as constraint_module
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.llamacpp import LlamaCppEngine

QUESTIONS = [
    "Describe your favourite city.",
    "Write a short story about a dragon.",
    "Explain how a bicycle works.",
    "Describe a day at the beach.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "What are the benefits of exercise?",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "minLength": 200},
        "confidence": {"type": "integer"},
        "topics": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["answer", "confidence", "topics"],
    "additionalProperties": False,
}
BATCH = 8


class GrammarClock:
    """Accumulates the time spent inside ``SequenceGrammar.mask_logits`` and ``consume``
    (wrapped for the benchmark only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        cls: Any = constraint_module.SequenceGrammar
        for name in ("mask_logits", "consume"):
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return wrapper


def run(
    engine: LlamaCppEngine,
    prompts: list[list[int]],
    tokens: int,
    constraint: OutputConstraint | None,
    clock: GrammarClock,
    seed: int,
) -> tuple[list[float], list[float]]:
    """Step 8 jobs to the end: (full-batch decode step times, grammar time per step)."""
    sampling = SamplingParams(temperature=0.8, seed=seed, constraint=constraint)
    for i, p in enumerate(prompts):
        engine.submit(EngineJob(f"b{i}", p, [ChoiceJob(0, tokens)], sampling))
    steps: list[float] = []
    grammar: list[float] = []
    while engine.has_work():
        prefilling = any(j.prefills or not j.admitted for j in engine._jobs.values())
        before = clock.seconds
        t = time.perf_counter()
        out = engine.step()
        elapsed = time.perf_counter() - t
        if not prefilling and sum(len(s.delta.token_ids) for s in out) == BATCH:
            steps.append(elapsed)
            grammar.append(clock.seconds - before)
    return steps, grammar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model_dir = prepare_bundled_model(Path(tempfile.gettempdir()) / "tokenrelay-bench-models")
    card = load_model_card(model_dir)
    assert card.gguf_file is not None
    builder = PromptBuilder.from_card(card)
    prompts = [builder.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    engine = LlamaCppEngine(
        card.path / card.gguf_file, n_ctx=4096, n_threads=args.threads, capacity=BATCH
    )
    clock = GrammarClock()
    constraint = OutputConstraint(kind="json_schema", json_schema=json.dumps(SCHEMA))
    # Warm-up: builds llguidance's vocabulary (once per engine) and the model's caches.
    run(engine, prompts, 8, constraint, clock, 0)
    run(engine, prompts, 8, None, clock, 0)

    plain: list[float] = []
    constrained: list[float] = []
    grammar: list[float] = []
    for r in range(args.rounds):
        plain += run(engine, prompts, args.tokens, None, clock, r)[0]
        steps, g = run(engine, prompts, args.tokens, constraint, clock, r)
        constrained += steps
        grammar += g
    engine.close()

    p = statistics.median(plain) * 1e3
    c = statistics.median(constrained) * 1e3
    gm = statistics.median(grammar) * 1e3
    print(f"batch {BATCH}, {args.threads} threads, {args.tokens} tokens, {args.rounds} rounds")
    print(f"unconstrained step: median {p:.2f} ms over {len(plain)} steps")
    print(f"constrained step:   median {c:.2f} ms over {len(constrained)} steps")
    print(f"difference:         {c - p:+.2f} ms ({(c - p) / p:+.1%} of the unconstrained step)")
    print(f"grammar per step:   median {gm:.2f} ms ({gm / c:.1%} of the constrained step)")


if __name__ == "__main__":
    main()
