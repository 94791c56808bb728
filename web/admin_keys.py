"""``/admin/keys``: API keys managed at run time (``broker.api_keys``), admin keys only.

- ``POST /admin/keys`` ``{"name", "admin", "weight", "requests_per_minute",
  "tokens_per_minute", "max_in_flight"}``: a new key; the answer holds its ``secret``,
  shown this once.
- ``GET /admin/keys``, ``GET /admin/keys/<id>``: the keys (never a secret).
- ``PATCH /admin/keys/<id>``: change name, admin flag or limits (any of the fields).
- ``POST /admin/keys/<id>/rotate``: a new secret; the old one fails from now on.
- ``DELETE /admin/keys/<id>``: revoke; its next request is 401 on every web process
  within a second, and its open streams end with an ``api_key_revoked`` error.

Managed keys exist only beside ``TOKENRELAY_API_KEYS`` (which turns authentication on
and holds the bootstrap admin keys): on an open server these routes answer 403.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, current_app, g, request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.errors import InvalidRequest, NotFound, PermissionDenied
from broker.api_keys import ApiKey, KeyCache, KeyLimits
from web.bodies import json_body
from web.context import runner_of, settings_of

blueprint = Blueprint("admin_keys", __name__)
ROUTE = "/admin/keys"


class KeyFields(BaseModel):
    """What a create or a PATCH may set."""

    # Strict: a security flag is a JSON boolean, never "yes" or 1 read as one.
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = Field(default=None, max_length=200)
    admin: bool | None = None
    weight: int | None = Field(default=None, ge=1, le=1000)
    requests_per_minute: int | None = Field(default=None, ge=0)
    tokens_per_minute: int | None = Field(default=None, ge=0)
    max_in_flight: int | None = Field(default=None, ge=0)

    def limits(self, base: KeyLimits) -> KeyLimits:
        given = self.model_dump(include=set(KeyLimits.model_fields), exclude_none=True)
        return base.model_copy(update=given)


def admin_only() -> None:
    """Refuse anyone but an admin key (``TOKENRELAY_ADMIN_API_KEYS`` or a managed key
    created with ``admin: true``); the app-wide hook has authenticated the key."""
    if not settings_of(current_app).api_keys:
        raise PermissionDenied(
            "The admin API needs API keys: set TOKENRELAY_API_KEYS (and "
            "TOKENRELAY_ADMIN_API_KEYS) first."
        )
    tenant = g.get("tenant")
    if tenant is None or not tenant.sees_all:
        raise PermissionDenied("This route needs an admin API key.")


def _cache() -> KeyCache:
    cache = runner_of(current_app).policy.cache
    assert cache is not None  # created with the app whenever api_keys are set
    return cache


def _fields() -> KeyFields:
    try:
        return KeyFields.model_validate(json_body(request) or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"{where}: {err['msg']}", param=where or None) from None


def _shown(key: ApiKey, secret: str | None = None) -> dict[str, Any]:
    body = {"object": "api_key", **key.public()}
    if secret is not None:
        body["secret"] = secret
    return body


def _found(key: ApiKey | None, key_id: str) -> ApiKey:
    if key is None:
        raise NotFound(f"No API key with id '{key_id}'.", param="key_id")
    return key


@blueprint.post(ROUTE)
def create_key() -> tuple[dict[str, Any], int]:
    admin_only()
    fields = _fields()
    key, secret = _cache().store.create(
        fields.name or "", admin=bool(fields.admin), limits=fields.limits(KeyLimits())
    )
    return _shown(key, secret), 201


@blueprint.get(ROUTE)
def list_keys() -> dict[str, Any]:
    admin_only()
    return {"object": "list", "data": [_shown(k) for k in _cache().store.list()]}


@blueprint.get(f"{ROUTE}/<key_id>")
def get_key(key_id: str) -> dict[str, Any]:
    admin_only()
    return _shown(_found(_cache().store.get(key_id), key_id))


@blueprint.patch(f"{ROUTE}/<key_id>")
def update_key(key_id: str) -> dict[str, Any]:
    admin_only()
    fields = _fields()
    store = _cache().store
    current = _found(store.get(key_id), key_id)
    key = store.update(
        key_id, name=fields.name, admin=fields.admin, limits=fields.limits(current.limits)
    )
    return _shown(_found(key, key_id))


@blueprint.post(f"{ROUTE}/<key_id>/rotate")
def rotate_key(key_id: str) -> dict[str, Any]:
    admin_only()
    rotated = _cache().store.rotate(key_id)
    if rotated is None:
        _found(None, key_id)
    assert rotated is not None
    return _shown(*rotated)


@blueprint.delete(f"{ROUTE}/<key_id>")
def revoke_key(key_id: str) -> Response | dict[str, Any]:
    admin_only()
    if not _cache().store.revoke(key_id):
        _found(None, key_id)
    return {"object": "api_key.deleted", "id": key_id, "deleted": True}
