"""Fixtures the engine tests on the bundled model share: its card and prompt builder."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.chat_template import PromptBuilder
from app.model_card import ModelCard, load_model_card


@pytest.fixture(scope="module")
def card(bundled_model_dir: Path) -> ModelCard:
    return load_model_card(bundled_model_dir)


@pytest.fixture(scope="module")
def builder(card: ModelCard) -> PromptBuilder:
    return PromptBuilder.from_card(card)
