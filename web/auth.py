"""API keys: ``Authorization: Bearer <key>`` on every ``/v1/`` route when keys are set.

With ``settings.api_keys`` empty the server is open. Health probes (``/health``,
``/ready``), ``/metrics`` and the static chat page stay open so that load balancers
and Prometheus need no secret; the page itself holds no data and its WebSocket is
authenticated. A view that authenticates differently (a browser WebSocket cannot set
headers) is marked with ``@exempt`` and calls ``check_key`` itself.

Tenants: with keys configured, what a key creates (files, batches) belongs to it: the
store keeps ``key_owner(key)`` (a SHA-256 of the key, never the key) beside the object,
and ``Tenant`` says whose objects a request may see. Admin keys, and every request when
no keys are configured, see all.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from flask import g, has_request_context

from app.errors import AuthenticationFailed
from app.settings import Settings
from broker.api_keys import KeyCache, secret_hash

F = TypeVar("F", bound=Callable[..., Any])

_EXEMPT_ATTR = "_tokenrelay_auth_exempt"


def exempt(view: F) -> F:
    """Mark a view that does its own authentication."""
    setattr(view, _EXEMPT_ATTR, True)
    return view


def is_exempt(view: Callable[..., Any] | None) -> bool:
    return bool(view is not None and getattr(view, _EXEMPT_ATTR, False))


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def key_ok(keys: Iterable[str], key: str | None) -> bool:
    """Whether ``key`` is one of ``keys`` (always true when no keys are configured).

    Compares in constant time so response timing does not leak key prefixes.
    """
    allowed = list(keys)
    if not allowed:
        return True
    if key is None:
        return False
    given = key.encode()
    found = False
    for k in allowed:
        found |= hmac.compare_digest(k.encode(), given)
    return found


def check_key(keys: Iterable[str], key: str | None) -> None:
    """Raise ``AuthenticationFailed`` (401) unless ``key`` is accepted."""
    if not key_ok(keys, key):
        raise AuthenticationFailed(
            "Incorrect API key provided."
            if key
            else "Missing API key: send 'Authorization: Bearer <key>'."
        )


def key_owner(key: str) -> str:
    """The owner id stored with an environment key's objects: a hash, so Redis never
    holds a key (a managed key's owner is its id)."""
    return secret_hash(key)


@dataclass(frozen=True, slots=True)
class Tenant:
    """Whose files and batches a request acts as.

    ``owner`` is stamped on what the request creates; ``sees_all`` (an admin key, or no
    keys configured) lets it read, delete and cancel any owner's objects.
    """

    owner: str
    sees_all: bool

    @property
    def scope(self) -> str | None:
        """The owner to filter by (None: every owner's objects)."""
        return None if self.sees_all else self.owner


def tenant_of(settings: Settings, authorization: str | None) -> Tenant:
    """The tenant of a request whose key the app-wide hook has already accepted (and
    kept: ``g.tenant``, which knows managed keys too)."""
    found: Tenant | None = g.get("tenant") if has_request_context() else None
    return found or tenant_for_key(settings, bearer_key(authorization))


def tenant_for_key(settings: Settings, key: str | None, managed: KeyCache | None = None) -> Tenant:
    """The tenant of an accepted key (a WebSocket may present it as ``?api_key=``): an
    environment key owns by its hash; a managed key (``broker.api_keys``) by its id, so
    its objects stay with it through a rotation."""
    if not settings.api_keys:
        return Tenant(owner="", sees_all=True)
    key = key or ""
    if managed is not None and not key_ok(settings.api_keys, key):
        found = managed.lookup(key)
        if found is not None:
            return Tenant(owner=found.id, sees_all=found.admin)
    admin = key_ok(settings.admin_api_keys, key) if settings.admin_api_keys else False
    return Tenant(owner=key_owner(key), sees_all=admin)


def authenticate(settings: Settings, key: str | None, managed: KeyCache | None) -> Tenant:
    """The tenant of ``key`` if it is an environment key or a live managed key; else
    ``AuthenticationFailed`` (401), saying so when the key was revoked."""
    if not settings.api_keys or key_ok(settings.api_keys, key):
        return tenant_for_key(settings, key)
    found = managed.lookup(key) if managed is not None and key else None
    if found is None:
        check_key(settings.api_keys, key)  # raises: missing or incorrect
    return tenant_for_key(settings, key, managed)
