"""Fixtures shared by the fault suites: the bundled model directory and its tokenizer,
prepared once per session (a module may still define its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(models_dir: Path) -> Tokenizer:
    from app.model_card import load_model_card, load_tokenizer

    return load_tokenizer(load_model_card(models_dir / "SmolLM2-135M-Instruct"))
