"""llama.cpp sampling for the llama.cpp engine: each choice's sampler chain, its seed,
and llguidance's view of the vocabulary (for constrained choices). Split from
workers/engines/llamacpp.py, which schedules and decodes.

Function names and signatures are those of llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import warnings
from typing import Any

import llama_cpp as lc

from app.records import SamplingParams
from workers.engines.base import EngineJob
from workers.engines.constraint import GrammarVocab

_SEED_MASK = 0xFFFFFFFF


def sampler_chain(job: EngineJob, index: int, prefix: list[int], n_vocab: int, window: int) -> Any:
    """llama.cpp's sampler chain for one choice, in vLLM's order of transforms.

    Repetition penalty covers prompt + output (as vLLM and HF apply it), presence
    and frequency penalties the output only (as OpenAI defines them): so they are
    two penalty samplers, and only the first is shown the prompt. ``window`` is the
    penalties' look-back (the context length).
    """
    sp = job.sampling
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    add = lc.llama_sampler_chain_add
    if sp.logit_bias:
        valid = [(t, b) for t, b in sp.logit_bias.items() if 0 <= t < n_vocab]
        biases = (lc.llama_logit_bias * len(valid))(*(lc.llama_logit_bias(t, b) for t, b in valid))
        add(chain, lc.llama_sampler_init_logit_bias(n_vocab, len(valid), biases))
    if sp.repetition_penalty != 1.0:
        rep = lc.llama_sampler_init_penalties(n_vocab, window, sp.repetition_penalty, 0.0, 0.0)
        for t in job.prompt_ids:
            lc.llama_sampler_accept(rep, t)
        add(chain, rep)
    if sp.frequency_penalty or sp.presence_penalty:
        add(
            chain,
            lc.llama_sampler_init_penalties(
                n_vocab, window, 1.0, sp.frequency_penalty, sp.presence_penalty
            ),
        )
    if sp.temperature == 0.0:
        add(chain, lc.llama_sampler_init_greedy())
    else:
        add(chain, lc.llama_sampler_init_temp(sp.temperature))
        if sp.top_k > 0:
            add(chain, lc.llama_sampler_init_top_k(sp.top_k))
        if sp.top_p < 1.0:
            add(chain, lc.llama_sampler_init_top_p(sp.top_p, 1))
        if sp.min_p > 0.0:
            add(chain, lc.llama_sampler_init_min_p(sp.min_p, 1))
        add(chain, lc.llama_sampler_init_dist(choice_seed(sp, index)))
    for t in prefix:  # a resumed choice's penalties continue where they were
        lc.llama_sampler_accept(chain, t)
    return chain


def plain_greedy(sp: SamplingParams) -> bool:
    """Whether ``sampler_chain`` for ``sp`` is the greedy sampler alone: then the token
    is the first maximum of the logits row, which numpy finds in ~5 µs where
    ``llama_sampler_sample`` spends ~45-150 µs building a candidate array of the whole
    vocabulary (measured here: ~2 % of a step at 8 sequences, on the cores llama.cpp
    computes on). The greedy sampler picks the first maximum too, and its accept does
    nothing, so the chain needs no feeding."""
    return (
        sp.temperature == 0.0
        and not sp.logit_bias
        and sp.repetition_penalty == 1.0
        and not sp.frequency_penalty
        and not sp.presence_penalty
    )


def choice_seed(sp: SamplingParams, index: int) -> int:
    """The seed of choice ``index``: ``seed + index`` so n>1 choices differ, yet a
    seeded request repeats; without a seed, llama.cpp draws one."""
    if sp.seed is None:
        return lc.LLAMA_DEFAULT_SEED
    seed = (sp.seed + index) & _SEED_MASK
    # LLAMA_DEFAULT_SEED itself means "random" to llama.cpp.
    return seed - 1 if seed == lc.LLAMA_DEFAULT_SEED else seed


def grammar_vocab(model: Any) -> GrammarVocab:
    """llguidance's tokenizer for a loaded llama.cpp model (~0.5 s: built once per
    engine, on its first constrained job). EOS and EOT end a constrained output."""
    from llguidance.llamacpp import lltokenizer_from_vocab

    vocab = lc.llama_model_get_vocab(model)
    eos = sorted({lc.llama_vocab_eos(vocab), lc.llama_vocab_eot(vocab)} - {-1})
    with warnings.catch_warnings():
        # llguidance reads token attributes through llama_token_get_attr, which this
        # llama-cpp-python marks deprecated (it is the same function).
        warnings.simplefilter("ignore", DeprecationWarning)
        tokenizer = lltokenizer_from_vocab(vocab, eos_token=eos)
    return GrammarVocab(tokenizer)


__all__ = ["choice_seed", "grammar_vocab", "sampler_chain"]
