"""The models one deployment serves, behind one front door (issue 41).

A worker declares the model it serves (``tokenrelay worker --model NAME``) and writes
its entry here when it starts: the served name, the directory its card was loaded from,
its engine and context length. The web tier and the streamers learn every model from
these entries, so nothing is configured per model: a request names its model, the web
tier prepares it with that model's card (chat template, tokenizer, context length) and
sends it to that model's Celery queues, and a streamer decodes it with that model's
tokenizer. The directory is read where the worker read it: the web tier, the streamers
and the workers share the models volume (one host, or the same mount everywhere).

Known is not live. An entry stays after its workers are gone, so that a model scaled to
zero is still known: a request for it gets 503 (retry) rather than 404, or waits for a
worker to start (``Settings.model_wait_s``). ``tokenrelay model remove NAME`` forgets a
model (its entry); a model with no entry and no live worker is unknown (404).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import redis
from pydantic import BaseModel, ConfigDict
from tokenizers import Tokenizer

from app.errors import NotFound
from app.model_card import ModelCard, load_model_card, load_tokenizer
from app.settings import Settings
from broker.keys import Keys
from broker.registry import Registry, WorkerInfo

# How long a read of the entries and of the live workers is reused: a request's start
# reads them once per second at most.
CACHE_S = 1.0
# Cards (and their tokenizers) kept loaded per process: least recently used go first.
MAX_CARDS = 8


class ModelEntry(BaseModel):
    """What a worker says of the model it serves."""

    model_config = ConfigDict(frozen=True)

    name: str
    model_dir: str
    engine: str
    context_length: int
    registered: float = 0.0


def model_not_found(name: str) -> NotFound:
    return NotFound(f"The model '{name}' does not exist.", param="model", code="model_not_found")


class ModelCatalog:
    """Every model this deployment serves: the entries workers wrote, which of them have
    live workers, the aliases, and the default model (the one a request without a
    ``model`` gets, served by this process's settings)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        workers: Registry[WorkerInfo],
        *,
        default: str,
        aliases: dict[str, str] | None = None,
        configured: list[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = client
        self.key = keys.models
        self.workers = workers
        self.default = default
        self.aliases = dict(aliases or {})
        # Known before any worker of theirs registered (Settings.known_models).
        self.configured = frozenset(configured or ())
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: tuple[float, dict[str, ModelEntry]] = (float("-inf"), {})
        self._live: tuple[float, dict[str, list[WorkerInfo]]] = (float("-inf"), {})

    # -- writing (workers, the CLI) ------------------------------------------------------
    def register(self, entry: ModelEntry) -> None:
        self.redis.hset(self.key, entry.name, entry.model_dump_json())

    def remove(self, name: str) -> bool:
        return bool(self.redis.hdel(self.key, name))

    # -- reading -------------------------------------------------------------------------
    def entries(self) -> dict[str, ModelEntry]:
        now = self.clock()
        with self._lock:
            at, cached = self._entries
            if now - at < CACHE_S:
                return cached
        try:
            raw = self.redis.hgetall(self.key)
        except redis.RedisError:
            if at == float("-inf"):
                raise
            return cached  # Redis away: what was known last (a request fails later)
        entries = {}
        for name, value in raw.items():
            try:
                entry = ModelEntry.model_validate_json(value)
            except ValueError:
                continue  # written by another version: ignored, not fatal
            entries[name.decode() if isinstance(name, bytes) else str(name)] = entry
        with self._lock:
            self._entries = (now, entries)
        return entries

    def live(self) -> dict[str, list[WorkerInfo]]:
        """Live workers by served model."""
        now = self.clock()
        with self._lock:
            at, cached = self._live
            if now - at < CACHE_S:
                return cached
        try:
            members = self.workers.live()
        except redis.RedisError:
            if at == float("-inf"):
                raise
            return cached
        by_model: dict[str, list[WorkerInfo]] = {}
        for w in members:
            by_model.setdefault(w.model, []).append(w)
        with self._lock:
            self._live = (now, by_model)
        return by_model

    def known(self) -> list[str]:
        """Every served name with an entry or a live worker, the default first."""
        names = {self.default, *self.entries(), *self.live(), *self.configured}
        return sorted(names, key=lambda n: (n != self.default, n))

    def resolve(self, asked: str | None) -> str:
        """The served model a request for ``asked`` goes to (None: the default); raises
        404 ``model_not_found`` for a name that is neither served, known nor an alias."""
        name = self.default if asked is None else asked
        served = self.aliases.get(name, name)
        if served == self.default or served in self.configured:
            return served
        if served in self.live() or served in self.entries():
            return served
        raise model_not_found(name)

    def aliases_of(self, served: str) -> list[str]:
        return sorted(a for a, s in self.aliases.items() if s == served)


class ModelCards:
    """Cards and tokenizers of the served models, loaded on first use from the directory
    their workers registered, at most ``MAX_CARDS`` kept (least recently used dropped).
    The default model's card is given and always kept."""

    def __init__(
        self,
        catalog: ModelCatalog,
        default_card: ModelCard,
        *,
        size: int = MAX_CARDS,
        fallback: Callable[[str], Path] | None = None,
    ) -> None:
        """``fallback``: the directory of a known model no worker has registered yet
        (``Settings.known_models``: its directory under models_dir)."""
        self.catalog = catalog
        self.default_card = default_card
        self.size = size
        self.fallback = fallback
        self._lock = threading.Lock()
        self._cards: OrderedDict[str, tuple[str, ModelCard]] = OrderedDict()
        self._tokenizers: OrderedDict[str, Tokenizer] = OrderedDict()

    def directory(self, served: str) -> Path:
        if served == self.catalog.default:
            return self.default_card.path
        entry = self.catalog.entries().get(served)
        if entry is not None:
            return Path(entry.model_dir)
        if self.fallback is not None and served in self.catalog.configured:
            return self.fallback(served)
        raise model_not_found(served)

    def card(self, served: str) -> ModelCard:
        """``served``'s card (raises ``ModelError`` naming what is wrong with it)."""
        if served == self.catalog.default:
            return self.default_card
        directory = str(self.directory(served))
        with self._lock:
            hit = self._cards.get(served)
            if hit is not None and hit[0] == directory:
                self._cards.move_to_end(served)
                return hit[1]
        card = load_model_card(Path(directory))
        with self._lock:
            self._cards[served] = (directory, card)
            self._cards.move_to_end(served)
            while len(self._cards) > self.size:
                self._cards.popitem(last=False)
        return card

    def tokenizer(self, served: str) -> Tokenizer:
        with self._lock:
            hit = self._tokenizers.get(served)
            if hit is not None:
                self._tokenizers.move_to_end(served)
                return hit
        tokenizer = load_tokenizer(self.card(served))
        with self._lock:
            self._tokenizers[served] = tokenizer
            while len(self._tokenizers) > self.size:
                self._tokenizers.popitem(last=False)
        return tokenizer


def settings_directory(settings: Settings) -> Callable[[str], Path]:
    """``ModelCards``'s fallback: where ``settings`` would find a model of that name."""

    def directory(name: str) -> Path:
        return settings.model_copy(update={"model": name, "served_model_name": None}).card_path()

    return directory


def catalog_of(
    client: redis.Redis, keys: Keys, workers: Registry[WorkerInfo], settings: Settings
) -> ModelCatalog:
    """The catalog as ``settings`` configure it (default model, aliases, known models)."""
    return ModelCatalog(
        client,
        keys,
        workers,
        default=settings.served_name,
        aliases=settings.model_aliases,
        configured=settings.known_models,
    )
