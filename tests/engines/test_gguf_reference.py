"""The GGUF -> HF conversion the GPU run depends on, checked independently here: the
converted FP16 weights under transformers agree with llama.cpp on the original GGUF.

The device run compares exllamav2 with transformers on the converted weights; were the
conversion wrong (a missed q/k un-permutation, a transposed tensor), both would be wrong
together only if they shared it, and llama.cpp shares nothing with them. Teacher-forced:
every token llama.cpp chose greedily must be within the margin of transformers' best
(Q4_1 weights dequantized either way; llama.cpp's Q8 activations part the two greedy
runs at near-ties, by up to 0.22 logits measured)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.model_card import ModelCard
from app.settings import Settings
from benchmarks.gguf_to_hf import convert_gguf_to_hf
from benchmarks.gpu_check import chat_prompts
from benchmarks.gpu_phases import engine_job
from benchmarks.gpu_reference import DEFAULT_MARGIN, TransformersReference
from tests.conftest import bundled_gguf
from workers.engines.llamacpp import LlamaCppEngine

pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKENS = 32


def test_transformers_on_the_converted_weights_agrees_with_llama_cpp(
    tmp_path: Path, card: ModelCard, models_dir: Path
) -> None:
    model_dir = convert_gguf_to_hf(bundled_gguf(), tmp_path / "model")
    ref = TransformersReference(model_dir, device="cpu")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(p, add_special_tokens=False).ids for p in chat_prompts(4)]
    engine = LlamaCppEngine.from_card(card, Settings(models_dir=models_dir, llamacpp_threads=2))
    try:
        ids: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            engine.submit(engine_job(str(i), p, TOKENS))
            ids[str(i)] = []
        while engine.has_work():
            for step in engine.step():
                ids[step.job_id] += step.delta.token_ids
    finally:
        engine.close()
    for i, p in enumerate(prompts):
        got = ref.check(p, ids[str(i)], margin=DEFAULT_MARGIN)
        assert got.tokens == TOKENS and got.over == 0, (i, got.summary(DEFAULT_MARGIN))
        assert got.argmax_equal >= TOKENS - 4
    # The check can fail: another prompt's answer, forced after this prompt, starts
    # many logits below transformers' best (then the model follows it).
    other = ref.check(prompts[0], ids["1"], margin=DEFAULT_MARGIN)
    assert other.over >= 4 and other.max_margin > 5
    # The converted directory is an HF model directory like any other: `tokenrelay model
    # add` takes it, for the exllamav2 engine (safetensors) under its own name.
    from app.model_card import load_model_card
    from app.prepare import add_model_directory

    added = load_model_card(add_model_directory(model_dir, tmp_path / "models"))
    assert added.name == "model" and "exllamav2" in added.engines()
    assert added.context_length == card.context_length
