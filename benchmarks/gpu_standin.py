"""The dry run's generator: exllamav2's stand-in, with transformers on the CPU as model.

``benchmarks/gpu_check.py --dry-run`` runs every phase of the device run here, where no
GPU and no exllamav2 exist, so that the one prepared call on a lent device cannot fail on
a mistake in the script. Only the generator is replaced: the stand-in of
tests/engines/exllamav2_standin.py (exllamav2 0.3.2's job, settings and scheduling rules)
whose next-token logits come from transformers running the converted model, so the
engine's ids, logprobs and penalties are checked against the reference for real.

Run as a module it is the worker of the worker phase, ``python -m workers`` with the
exllamav2 engine built on that stand-in instead of a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu_phases import Backend
from benchmarks.gpu_reference import TransformersReference
from tests.engines.exllamav2_standin import StandInDynamicGenerator, stand_in_api
from workers.engines.exllamav2 import ExLlamaV2Engine


def stand_in_generator(
    ref: TransformersReference, vocab_size: int, paged: bool, max_batch_size: int, cache: int
) -> StandInDynamicGenerator:
    return StandInDynamicGenerator(
        cache_tokens=cache,
        max_batch_size=max_batch_size,
        paged=paged,
        logits=ref.next_logits,
        vocab_size=vocab_size,
    )


def stand_in_backend(ref: TransformersReference, vocab_size: int) -> Backend:
    return Backend(
        name="stand-in generator on transformers (CPU)",
        api=stand_in_api(),
        vocab_size=vocab_size,
        new_generator=lambda paged, batch, cache: stand_in_generator(
            ref, vocab_size, paged, batch, cache
        ),
    )


def _from_card(card: Any, settings: Any) -> ExLlamaV2Engine:
    """``ExLlamaV2Engine.from_card`` with the stand-in generator on the card's weights."""
    import torch

    torch.set_num_threads(1)  # the worker shares two cores with the streamer and the run
    ref = TransformersReference(Path(card.path), device="cpu")
    vocab = int(card.vocab_size)
    gen = stand_in_generator(
        ref, vocab, True, settings.worker_slots * settings.max_n, settings.exllamav2_cache_tokens
    )
    return ExLlamaV2Engine(gen, vocab_size=vocab, api=stand_in_api())


def main(argv: list[str] | None = None) -> int:
    from workers.__main__ import main as worker_main

    ExLlamaV2Engine.from_card = _from_card  # type: ignore[method-assign]
    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
