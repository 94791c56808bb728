"""API keys: ``Authorization: Bearer <key>`` on every ``/v1/`` route when keys are set.

With ``settings.api_keys`` empty the server is open. Health probes (``/health``,
``/ready``), ``/metrics`` and the static chat page stay open so that load balancers
and Prometheus need no secret; the page itself holds no data and its WebSocket is
authenticated. A view that authenticates differently (a browser WebSocket cannot set
headers) is marked with ``@exempt`` and calls ``check_key`` itself.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from app.errors import AuthenticationFailed

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
