"""API keys managed at run time: created, listed, rotated and revoked without a restart.

Why in Redis: every web process must agree on the keys within a second, and a restart
of every web process to add a customer is what operators of a shared deployment asked
to stop doing. The keys in ``TOKENRELAY_API_KEYS`` still work (bootstrap and admin
keys); they are what turns authentication on, so a server with no key in its
environment stays open and has no managed keys either.

Storage (``broker.keys.Keys``): ``{p}apikeys`` maps a key id to its record (JSON: name,
limits, weight, the SHA-256 of its current secret, never the secret);
``{p}apikeys:secrets`` maps that hash back to the id (the lookup of a presented key);
``{p}apikeys:revoked`` keeps revoked ids with the time; ``{p}apikeys:version`` counts
changes. Every change is one MULTI/EXEC that bumps the version.

Each web process holds a ``KeyCache``: read, it looks at the version when its copy is
older than ``REFRESH_S`` and reloads the maps when it moved; open streams look whether
their key was revoked at every read. A revoke or a rotation therefore takes effect on
every process within ``REFRESH_S`` plus a round trip. A managed key's requests, files
and batches belong to its id (``owner``), so a rotation keeps them with the key.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from pydantic import BaseModel, Field

from broker.keys import Keys

logger = logging.getLogger(__name__)

#: How often a web process looks for key changes (a revoke holds within about this).
REFRESH_S = 0.25
SECRET_PREFIX = "sk-tr-"


def secret_hash(secret: str) -> str:
    """What Redis keeps of a secret (and the owner of an environment key's objects)."""
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyLimits(BaseModel):
    """What a managed key may do; 0 (or None) falls back to the server's settings."""

    weight: int = Field(default=1, ge=1, le=1000)
    requests_per_minute: int = Field(default=0, ge=0)
    tokens_per_minute: int = Field(default=0, ge=0)
    max_in_flight: int = Field(default=0, ge=0)


class ApiKey(BaseModel):
    """A managed key's record (its secret is shown once, at create or rotate)."""

    id: str
    name: str = ""
    admin: bool = False
    limits: KeyLimits = Field(default_factory=KeyLimits)
    created: float
    rotated: float | None = None
    hint: str = ""  # the secret's last four characters, to tell keys apart
    secret_sha256: str = ""

    def public(self) -> dict[str, object]:
        """The record as the admin API shows it (no hash)."""
        return self.model_dump(mode="json", exclude={"secret_sha256"})


def _new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


class ApiKeyStore:
    """The managed keys in Redis: every change in one transaction with the version."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys

    def create(
        self, name: str, *, admin: bool = False, limits: KeyLimits | None = None
    ) -> tuple[ApiKey, str]:
        """A new key and its secret (shown once)."""
        secret = _new_secret()
        key = ApiKey(
            id=f"key_{secrets.token_hex(6)}",
            name=name,
            admin=admin,
            limits=limits or KeyLimits(),
            created=time.time(),
            hint=secret[-4:],
            secret_sha256=secret_hash(secret),
        )
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.api_keys, key.id, key.model_dump_json())
        pipe.hset(self.keys.api_key_secrets, key.secret_sha256, key.id)
        pipe.incr(self.keys.api_keys_version)
        pipe.execute()
        return key, secret

    def get(self, key_id: str) -> ApiKey | None:
        raw = self.redis.hget(self.keys.api_keys, key_id)
        return None if raw is None else ApiKey.model_validate_json(raw)

    def list(self) -> list[ApiKey]:
        raw = self.redis.hgetall(self.keys.api_keys)
        return sorted(
            (ApiKey.model_validate_json(v) for v in raw.values()), key=lambda k: k.created
        )

    def update(self, key_id: str, *, name: str | None = None, admin: bool | None = None,
               limits: KeyLimits | None = None) -> ApiKey | None:  # fmt: skip
        """Change a key's name, admin flag or limits (its secret stays)."""
        return self._change(key_id, lambda k: k.model_copy(update={
            "name": k.name if name is None else name,
            "admin": k.admin if admin is None else admin,
            "limits": k.limits if limits is None else limits,
        }))[0]  # fmt: skip

    def rotate(self, key_id: str) -> tuple[ApiKey, str] | None:
        """A new secret for the key; the old one stops working. None: no such key."""
        secret = _new_secret()
        key, old = self._change(key_id, lambda k: k.model_copy(update={
            "rotated": time.time(), "hint": secret[-4:], "secret_sha256": secret_hash(secret),
        }))  # fmt: skip
        return None if key is None or old is None else (key, secret)

    def revoke(self, key_id: str) -> bool:
        """Delete the key; its secret fails from now on, its open streams end."""
        return self._change(key_id, lambda _key: None)[1] is not None

    def _change(
        self, key_id: str, change: Callable[[ApiKey], ApiKey | None]
    ) -> tuple[ApiKey | None, ApiKey | None]:
        """Apply ``change`` to the key under WATCH (None: revoke it); (new, old), and
        (None, None) when there is no such key."""
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(self.keys.api_keys)  # type: ignore[no-untyped-call]
                    raw = pipe.hget(self.keys.api_keys, key_id)
                    if raw is None:
                        return None, None
                    old = ApiKey.model_validate_json(raw)
                    new = change(old)
                    pipe.multi()
                    if new is None:
                        pipe.hdel(self.keys.api_keys, key_id)
                        pipe.hset(self.keys.api_keys_revoked, key_id, str(time.time()))
                    else:
                        pipe.hset(self.keys.api_keys, key_id, new.model_dump_json())
                    if new is None or new.secret_sha256 != old.secret_sha256:
                        pipe.hdel(self.keys.api_key_secrets, old.secret_sha256)
                    if new is not None and new.secret_sha256 != old.secret_sha256:
                        pipe.hset(self.keys.api_key_secrets, new.secret_sha256, key_id)
                    pipe.incr(self.keys.api_keys_version)
                    pipe.execute()
                    return new, old
                except redis.WatchError:
                    continue


@dataclass
class _Snapshot:
    version: bytes | None = None
    by_hash: dict[str, ApiKey] = field(default_factory=dict)
    by_id: dict[str, ApiKey] = field(default_factory=dict)
    revoked: frozenset[str] = frozenset()


class KeyCache:
    """One process's copy of the managed keys, never older than ``refresh_s`` when
    read: a read after that looks at the version first (one GET; the maps are read
    again only when it moved). Whoever reads refreshes, one thread at a time; the others
    use the copy they find. Redis away: the last copy stands."""

    def __init__(
        self,
        store: ApiKeyStore,
        *,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.refresh_s = refresh_s
        self.clock = clock
        self._snap = _Snapshot()
        self._due = 0.0
        self._refreshing = threading.Lock()

    def lookup(self, secret: str) -> ApiKey | None:
        """The managed key whose secret this is, else None. A miss looks at Redis again
        at once (one GET of the version; the maps only when it moved): a key created a
        moment ago, on any process, works at once."""
        hashed = secret_hash(secret)
        found = self._current().by_hash.get(hashed)
        if found is None:
            self._due = 0.0
            found = self._current().by_hash.get(hashed)
        return found

    def revoked(self, owner: str) -> bool:
        """Whether ``owner`` is a managed key that has been revoked."""
        if not owner.startswith("key_"):
            return False
        snap = self._current()
        return owner not in snap.by_id and owner in snap.revoked

    def key(self, owner: str) -> ApiKey | None:
        """The managed key with this id (an environment key's owner is not one)."""
        if not owner.startswith("key_"):
            return None
        return self._current().by_id.get(owner)

    def _current(self) -> _Snapshot:
        if self.clock() >= self._due and self._refreshing.acquire(blocking=False):
            try:
                self.refresh()
            except redis.RedisError as exc:
                logger.debug("could not read the API keys (%s); using the last copy", exc)
            finally:
                self._due = self.clock() + self.refresh_s
                self._refreshing.release()
        return self._snap

    def refresh(self) -> bool:
        """Reload if the version moved; whether it did."""
        r, k = self.store.redis, self.store.keys
        version = r.get(k.api_keys_version)
        if version == self._snap.version:
            return False
        pipe = r.pipeline(transaction=True)
        pipe.get(k.api_keys_version)
        pipe.hgetall(k.api_keys)
        pipe.hkeys(k.api_keys_revoked)
        version, records, revoked = pipe.execute()
        keys = [ApiKey.model_validate_json(v) for v in records.values()]
        self._snap = _Snapshot(
            version=version,
            by_hash={key.secret_sha256: key for key in keys},
            by_id={key.id: key for key in keys},
            revoked=frozenset(x.decode() if isinstance(x, bytes) else str(x) for x in revoked),
        )
        return True
