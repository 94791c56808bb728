"""Shared fixtures: the bundled model's tokenizer, built once per session, and OpenAI SDK
clients closed when their test ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tokenizers import Tokenizer

if TYPE_CHECKING:
    import openai


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


@pytest.fixture
def sdk_client() -> Iterator[Callable[..., openai.OpenAI]]:
    """``sdk_client(base_url, **kwargs)``: an OpenAI client (no retries, the key
    "unused" unless given), closed when the test ends. A client left to the garbage
    collector is a reference cycle: its sockets may be finalized before the client
    closes them, a ResourceWarning (an error in this suite) in whatever test runs then."""
    import openai

    made: list[openai.OpenAI] = []

    def make(base_url: str, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        made.append(openai.OpenAI(base_url=base_url, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()
