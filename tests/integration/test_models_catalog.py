"""The catalog of served models and their cards (``broker.models``) on a real Redis:
what a name resolves to, what stays known after the last worker, and the bounded cache
of cards."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis

from app.errors import NotFound
from app.model_card import ModelCard
from broker.keys import Keys
from broker.models import ModelCards, ModelCatalog, ModelEntry
from broker.registry import WorkerInfo, worker_registry

pytestmark = pytest.mark.integration


@pytest.fixture
def catalog(redis_client: redis.Redis) -> ModelCatalog:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}:")
    now = [0.0]
    cat = ModelCatalog(
        redis_client,
        keys,
        worker_registry(redis_client, keys, ttl_s=60),
        default="default-model",
        aliases={"gpt-4o-mini": "model-b", "dangling": "never-served"},
        configured=["scaled-to-zero"],
        clock=lambda: now[0],
    )
    cat.tick = now  # type: ignore[attr-defined]
    return cat


def serve(catalog: ModelCatalog, name: str, directory: Path) -> WorkerInfo:
    info = WorkerInfo(
        worker_id=f"w-{name}",
        model=name,
        engine="echo",
        capacity=1,
        hostname="h",
        pid=1,
        started=0.0,
    )
    catalog.workers.heartbeat(info)
    catalog.register(
        ModelEntry(name=name, model_dir=str(directory), engine="echo", context_length=4096)
    )
    return info


def test_names_resolve_to_served_models_and_unknown_ones_are_404(
    catalog: ModelCatalog, bundled_model_dir: Path
) -> None:
    serve(catalog, "model-b", bundled_model_dir)
    assert catalog.resolve(None) == "default-model"
    assert catalog.resolve("model-b") == "model-b"
    assert catalog.resolve("gpt-4o-mini") == "model-b"
    assert catalog.resolve("scaled-to-zero") == "scaled-to-zero"
    for unknown in ("model-c", "dangling"):
        with pytest.raises(NotFound) as exc:
            catalog.resolve(unknown)
        assert exc.value.code == "model_not_found"
    assert catalog.known() == ["default-model", "model-b", "scaled-to-zero"]
    assert catalog.aliases_of("model-b") == ["gpt-4o-mini"]


def test_a_model_stays_known_after_its_last_worker_until_removed(
    catalog: ModelCatalog, bundled_model_dir: Path
) -> None:
    info = serve(catalog, "model-b", bundled_model_dir)
    catalog.workers.unregister(info.member_id)
    catalog.tick[0] += 2  # type: ignore[attr-defined]  # past the cached reads
    assert "model-b" not in catalog.live()
    assert catalog.resolve("model-b") == "model-b"  # known: 503 or a wait, not 404
    assert catalog.remove("model-b") and not catalog.remove("model-b")
    catalog.tick[0] += 2  # type: ignore[attr-defined]
    with pytest.raises(NotFound):
        catalog.resolve("model-b")


def test_cards_load_on_first_use_and_the_least_recent_go_first(
    catalog: ModelCatalog, card: ModelCard, bundled_model_dir: Path, tmp_path: Path
) -> None:
    for name in ("model-b", "model-c"):
        serve(catalog, name, bundled_model_dir)
    cards = ModelCards(catalog, card, size=1, fallback=lambda name: bundled_model_dir)
    assert cards.card("default-model") is card  # the process's own, always kept
    b = cards.card("model-b")
    assert b.path == bundled_model_dir and cards.card("model-b") is b  # cached
    cards.card("model-c")  # size 1: model-b's card is dropped ...
    assert cards.card("model-b") is not b  # ... and read again
    assert (
        cards.tokenizer("model-b").get_vocab_size() == cards.tokenizer("model-c").get_vocab_size()
    )
    assert cards.card("scaled-to-zero").path == bundled_model_dir  # no entry: its fallback
    with pytest.raises(NotFound):
        cards.card("model-x")
