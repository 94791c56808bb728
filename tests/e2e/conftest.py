"""e2e fixtures: a whole stack of real processes (``tests.stack.full_stack``) shared by
the session: redis-server, a Celery worker with the echo engine, a streamer, and
``tokenrelay web`` (gunicorn, two worker processes so metrics aggregation is real).

Tests that need other settings start their own stack, or another web process on this
stack's Redis (``tests.stack.web_process`` with ``web_settings(stack.settings, ...)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import Stack, full_stack, isolated_settings
from tests.stack import in_flight as in_flight  # e2e tests import it from here


@pytest.fixture(scope="session")
def model_dir(models_dir: Path) -> Path:
    return models_dir / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused", models_dir, web_workers=2, web_threads=32, sse_keepalive_s=1.0
    )
    with full_stack(settings, tmp_path_factory.mktemp("e2e-logs")) as running:
        yield running


SLOW_RATE = 20.0  # echo tokens per second on the slow stack


@pytest.fixture(scope="session")
def slow_stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose echo engine makes 20 tokens/s and whose web admits one request:
    for disconnects, admission and anything that must stay in flight for a while. A
    disconnect cancels at once here (no resume grace)."""
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=SLOW_RATE,
        max_queue=1,
        web_workers=1,
        web_threads=8,
        sse_keepalive_s=0.5,
        resume_grace_s=0.0,
    )
    with full_stack(settings, tmp_path_factory.mktemp("slow-logs")) as running:
        yield running
