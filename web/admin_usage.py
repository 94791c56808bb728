"""``GET /admin/usage``: the usage ledger (``broker.usage_ledger``), admin keys only.

Query: ``key`` (an owner, i.e. a managed key's id or an environment key's SHA-256 hash,
or its first 16 characters), ``model``, ``api`` (``/v1/chat/completions``,
``/v1/completions``, ``/v1/messages``, ``/v1/responses`` or ``batch``), ``from`` and
``to`` (UTC, inclusive: ``YYYY-MM-DD``, or ``YYYY-MM-DDTHH`` with hours),
``granularity`` (``day``, the default, or ``hour``); at most 400 days or 744 hours at
once (400 otherwise, as for a malformed date). The answer: one row per key, model, API
and period with its counts, and their totals.

With keys configured only an admin key may read it (403 otherwise: the ledger names
every key's use); an open server (no keys) answers anyone, as it does for everything.
"""

from __future__ import annotations

import time

from flask import Blueprint, Response, current_app, jsonify, request

from app.errors import PermissionDenied
from app.usage import UsageQuery, totals_of
from broker.usage_ledger import UsageLedger
from web.auth import tenant_of
from web.context import runner_of, settings_of

blueprint = Blueprint("admin_usage", __name__)


@blueprint.get("/admin/usage")
def usage() -> Response:
    settings = settings_of(current_app)
    tenant = tenant_of(settings, request.headers.get("Authorization"))
    if not tenant.sees_all:
        raise PermissionDenied("The usage ledger needs an admin API key.")
    query = UsageQuery.parse(request.args, time.time())
    runner = runner_of(current_app)
    rows = UsageLedger(runner.redis, runner.keys).read(query)
    return jsonify(
        {
            "object": "list",
            "granularity": query.granularity,
            "from": query.periods[0],
            "to": query.periods[-1],
            "data": [row.to_dict() for row in rows],
            "totals": totals_of(rows),
        }
    )
