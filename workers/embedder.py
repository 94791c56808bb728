"""A worker's embedding model: llama.cpp's embedding mode on the model's GGUF (issue 42).

Loaded on the first embedding request, not at start: most workers never get one, and a
second copy of the weights in memory is not free. Its own llama.cpp context, apart from
the generation engine's, so an embedding never waits for a generation step; one request
at a time (a lock), every input of the request in one batch of sequences.

llama-cpp-python's ``Llama.embed`` tokenizes text itself; the web tier has already
tokenized the inputs (it counts them and checks their length), so this decodes the ids
as they are, the way ``embed`` does (one sequence per input, every token an output).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from app.embeddings_api import EMBED_MAX_TOKENS
from app.model_card import ModelCard
from app.settings import Settings

logger = logging.getLogger(__name__)

# Inputs decoded in one batch.
EMBED_MAX_SEQUENCES = 16


def can_embed(settings: Settings, card: ModelCard) -> bool:
    """Whether a worker of ``card`` serves embeddings: enabled, a GGUF, llama.cpp here."""
    import importlib.util

    return (
        settings.embeddings
        and card.gguf_file is not None
        and importlib.util.find_spec("llama_cpp") is not None
    )


class Embedder:
    """``embed(token id lists) -> vectors`` with llama.cpp, loaded on first use."""

    def __init__(self, card: ModelCard, settings: Settings) -> None:
        assert card.gguf_file is not None
        self.path = Path(card.path) / card.gguf_file
        self.n_ctx = min(card.context_length, EMBED_MAX_TOKENS)
        self.threads = settings.llamacpp_threads
        self._llm: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        import llama_cpp

        llm = self._open(llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED)
        if int(llm.pooling_type()) == llama_cpp.LLAMA_POOLING_TYPE_NONE:
            # A generative model names no pooling: one vector per input needs one.
            llm.close()
            llm = self._open(llama_cpp.LLAMA_POOLING_TYPE_MEAN)
        logger.info("embedding model loaded from %s (pooling %d)", self.path, llm.pooling_type())
        return llm

    def _open(self, pooling: int) -> Any:
        import llama_cpp

        return llama_cpp.Llama(
            str(self.path),
            embedding=True,
            n_ctx=self.n_ctx,
            n_batch=self.n_ctx,
            n_ubatch=self.n_ctx,
            n_threads=self.threads,
            pooling_type=pooling,
            verbose=False,
        )

    @property
    def dimensions(self) -> int | None:
        """The vectors' width, once loaded."""
        return int(self._llm.n_embd()) if self._llm is not None else None

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector per input, in order (not normalized: OpenAI's are unit length for
        its own models only; clients normalize as they need)."""
        import llama_cpp

        for ids in inputs:
            if not ids or len(ids) > self.n_ctx:
                raise ValueError(f"an input must have 1 to {self.n_ctx} tokens")
        with self._lock:
            if self._llm is None:
                self._llm = self._load()
            llm = self._llm
            n_embd = llm.n_embd()
            most = min(EMBED_MAX_SEQUENCES, llm.context_params.n_seq_max)
            out: list[list[float]] = []
            batch: list[list[int]] = []

            def decode(seqs: list[list[int]]) -> None:
                llm._batch.reset()
                for seq_id, ids in enumerate(seqs):
                    llm._batch.add_sequence(ids, seq_id, True)
                llm._ctx.kv_cache_clear()
                llm._ctx.decode(llm._batch)
                for seq_id in range(len(seqs)):
                    ptr = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, seq_id)
                    out.append([float(x) for x in ptr[:n_embd]])
                llm._batch.reset()

            for ids in inputs:
                full = sum(len(s) for s in batch) + len(ids) > self.n_ctx
                if batch and (full or len(batch) == most):
                    decode(batch)
                    batch = []
                batch.append(ids)
            if batch:
                decode(batch)
            return out

    def close(self) -> None:
        with self._lock:
            if self._llm is not None:
                self._llm.close()
                self._llm = None
