"""Shared fixtures: the bundled model's tokenizer, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer


def bundled_gguf() -> Path:
    from app.prepare import bundled_gguf_path

    return bundled_gguf_path()


@pytest.fixture(scope="session")
def smollm_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The SmolLM2 tokenizer built from the bundled GGUF (round-tripped through JSON)."""
    from app.gguf_tokenizer import read_gguf_vocab

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    read_gguf_vocab(bundled_gguf()).tokenizer.save(str(path))
    return Tokenizer.from_file(str(path))
