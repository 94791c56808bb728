"""Fixtures the engine tests on the bundled model share: its prompt builder (the card is
tests/conftest.py's)."""

from __future__ import annotations

import pytest

from app.chat_template import PromptBuilder
from app.model_card import ModelCard


@pytest.fixture(scope="module")
def builder(card: ModelCard) -> PromptBuilder:
    return PromptBuilder.from_card(card)
