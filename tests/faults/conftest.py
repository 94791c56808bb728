"""Fixtures shared by the fault suites: the bundled model directory and its tokenizer,
prepared once per session (a module may still define its own); for the suites whose
client loses its web process (``test_resume``, ``test_responses_failover``) a stack with
two web servers: B, shared by the module (``backbone``), and A, started per test
(``web_a``), each killable by the process group we started it in; and the settings of a
stack whose last worker dies (``test_last_worker``, ``test_web_outage``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tokenizers import Tokenizer

from app.settings import Settings
from broker.cluster_server import LocalCluster
from tests.stack import Proc, full_stack, isolated_settings, web_process, web_settings
from workers.runtime import HEARTBEAT_S

if TYPE_CHECKING:
    import openai

logger = logging.getLogger(__name__)

RATE = 25.0  # echo tokens per second on the backbone: a reply of TEXT takes ~5 s
# Emoji and CJK: multi-byte characters split over tokens must not be cut or repeated.
TEXT = " ".join(
    f"part {i}: the quick brown fox 🦊 jumps over the lazy dog; 東京 is far." for i in range(4)
)
WAIT_S = 30.0  # bound of every wait on a stream


@pytest.fixture(scope="session")
def tokenizer(models_dir: Path) -> Tokenizer:
    from app.model_card import load_model_card, load_tokenizer

    return load_tokenizer(load_model_card(models_dir / "SmolLM2-135M-Instruct"))


@dataclass
class Web:
    """One web server of the test: its base URL, its process and its settings."""

    url: str
    proc: Proc
    settings: Settings
    clients: list[openai.OpenAI] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        """A client of this web process, closed by its fixture (``close``). One left to
        the garbage collector is a cycle: its sockets may be finalized before the client
        closes them, a ResourceWarning (an error here) in whatever test runs then."""
        import openai

        c = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S
        )
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def kill_group(self) -> None:
        """SIGKILL the gunicorn master and its workers, by the PID we started."""
        self.proc.kill_group()
        logger.info("killed web process group %s", self.proc.pid)


@dataclass
class Backbone:
    """What every web server shares: settings (redis, worker, streamer) and web B."""

    settings: Settings
    logs: Path
    b: Web


@pytest.fixture(scope="module")
def backbone_cluster() -> bool:
    """Whether the module's backbone runs its token traffic on a Redis Cluster (3 masters
    + 3 replicas; Celery on the redis-server): a module overrides it."""
    return False


@pytest.fixture(scope="module")
def backbone(
    request: pytest.FixtureRequest,
    models_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    resume_grace_s: float,
    backbone_cluster: bool,
) -> Iterator[Backbone]:
    """redis-server, a worker (echo engine at ``RATE``), a streamer and web B, for the
    module; ``resume_grace_s`` is the module's own fixture, ``backbone_cluster`` too."""
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=RATE,
        resume_grace_s=resume_grace_s,
        sse_keepalive_s=0.5,
        web_workers=2,
        web_threads=8,
    )
    logs = tmp_path_factory.mktemp(f"{request.module.__name__.rpartition('.')[2]}-logs")
    cluster = LocalCluster(3, 1) if backbone_cluster else None
    with full_stack(settings, logs, web="web-b", cluster=cluster) as stack:
        web_b = Web(stack.base_url, stack.procs["web-b"], stack.settings)
        try:
            yield Backbone(stack.settings, stack.log_dir, web_b)
        finally:
            web_b.close()


@pytest.fixture
def web_a(backbone: Backbone) -> Iterator[Web]:
    """Web A: the same settings as B but for its port, a fresh process per test."""
    a_settings = web_settings(backbone.settings)
    assert a_settings.model_dump(exclude={"port"}) == backbone.b.settings.model_dump(
        exclude={"port"}
    )
    with web_process(a_settings, backbone.logs, name="web-a") as proc:
        web = Web(f"http://{a_settings.host}:{a_settings.port}", proc, a_settings)
        try:
            yield web
        finally:
            web.close()


# -- the last worker dies (test_last_worker; test_web_outage, the web side) ----------------

NO_WORKER_TIMEOUT_S = 2.0
LEASE_TTL_S = 1.5
REGISTRATION_TTL_S = 5 * HEARTBEAT_S  # workers register with this TTL (workers.runtime)


def last_worker_settings(models_dir: Path, **overrides: object) -> Settings:
    """Settings for a stack whose only worker is SIGKILLed: echo at 10 tokens/s (a
    request is still running at the kill), a short lease and no-worker timeout."""
    return isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=10.0,
        lease_ttl_s=LEASE_TTL_S,
        no_worker_timeout_s=NO_WORKER_TIMEOUT_S,
        **overrides,
    )
