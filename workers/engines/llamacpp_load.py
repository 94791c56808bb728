"""Loading a GGUF into llama.cpp: the model, its context, and the CPU check that
decides ggml's extra weight buffers (``workers.engines.llamacpp`` drives what this
makes)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import llama_cpp as lc


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has Intel AMX (which ggml uses through its extra buffers)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(
        line.startswith("flags") and "amx_int8" in line.split() for line in text.splitlines()
    )


def load_model(model_path: Path, use_extra_bufts: bool, *, verbose: bool = False) -> Any:
    """The model's weights, loaded by llama.cpp (raises when it cannot)."""
    if not verbose:
        # llama.cpp logs through llama-cpp-python's logger, which prints every level
        # unless raised (what Llama(verbose=False) does too).
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.use_extra_bufts = use_extra_bufts
    model = lc.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    return model


def new_context(
    model: Any, model_path: Path, *, n_ctx: int, n_batch: int, n_seq_max: int, threads: int
) -> Any:
    """A llama.cpp context over ``model`` with one unified KV cache: any sequence may
    grow to the whole context, and n choices of one prompt share its cells (a batch
    token may carry several sequence ids). Frees the model when it cannot be made."""
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = n_batch
    cparams.n_ubatch = n_batch
    cparams.n_seq_max = n_seq_max
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.kv_unified = True
    cparams.no_perf = True
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError(f"llama.cpp could not create a context for {model_path}")
    return ctx
