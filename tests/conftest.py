"""Shared fixtures: the bundled model's tokenizer, built once per session, and OpenAI SDK
clients closed when their test ends; and a check that no test leaves a client open."""

from __future__ import annotations

import gc
import os
import sys
import weakref
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


# -- OpenAI clients left to the garbage collector ----------------------------------------
# Such a client is a reference cycle, so the collector frees it at some later point, in
# whatever test runs then; its sockets may be finalized before it closes them, and the
# ResourceWarning (an error here) fails that unrelated test, now and then. This makes
# the cause a certain failure that names where the client was made: each client gets a
# finalizer that records it if it was never closed, and the session fails if any was.
_LEFT_OPEN: list[str] = []


def _track_openai_clients() -> None:
    """Wrap ``openai.OpenAI`` once it is imported (not before: importing it takes ~1 s,
    which a run of the unit tests alone should not pay)."""
    openai = sys.modules.get("openai")
    if openai is None or getattr(openai.OpenAI, "_tokenrelay_tracked", False):
        return
    cls = openai.OpenAI
    init, close = cls.__init__, cls.close

    def tracked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        closed = self._tokenrelay_closed = [False]
        where = os.environ.get("PYTEST_CURRENT_TEST", "outside a test").rsplit(" (", 1)[0]
        weakref.finalize(self, _collected, closed, where)

    def tracked_close(self: Any) -> None:
        getattr(self, "_tokenrelay_closed", [False])[0] = True
        close(self)

    cls.__init__, cls.close = tracked_init, tracked_close
    cls._tokenrelay_tracked = True


def _collected(closed: list[bool], where: str) -> None:
    if not closed[0]:
        _LEFT_OPEN.append(where)


def pytest_collection_finish(session: pytest.Session) -> None:
    _track_openai_clients()  # test modules that import openai at the top are loaded


def pytest_runtest_setup(item: pytest.Item) -> None:
    _track_openai_clients()  # a module or fixture that imported it lazily


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gc.collect()
    if _LEFT_OPEN:
        where = "\n  ".join(sorted(set(_LEFT_OPEN)))
        sys.stderr.write(
            f"\n{len(_LEFT_OPEN)} OpenAI client(s) were never closed (use `with` or the "
            f"sdk_client fixture); made in:\n  {where}\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
