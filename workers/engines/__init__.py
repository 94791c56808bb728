"""Engines: one small interface (``Engine``) and its implementations.

Import an implementation through ``load_engine`` so that heavy libraries (llama.cpp,
exllamav2 and its CUDA build) are imported only by the worker that uses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.model_card import ModelCard
    from app.settings import Settings
    from workers.engines.base import Engine


def load_engine(settings: Settings, card: ModelCard, name: str | None = None) -> Engine:
    """Build the configured engine for ``card`` (imports its library only now)."""
    name = name or settings.engine
    if name == "echo":
        from workers.engines.echo import EchoEngine

        return EchoEngine(
            tokens_per_second=settings.echo_tokens_per_second,
            max_batch=max(settings.worker_slots * settings.max_n, 256),
            context_length=card.context_length,
            vocab_size=card.vocab_size or 49152,
        )
    if name == "llamacpp":
        from workers.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine.from_card(card, settings)
    if name == "exllamav2":
        from workers.engines.exllamav2 import ExLlamaV2Engine

        return ExLlamaV2Engine.from_card(card, settings)
    raise ValueError(f"unknown engine {name!r}")
