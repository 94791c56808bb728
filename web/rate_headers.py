"""Rate-limit headers on every answer to a rate-limited key (OpenAI's and Anthropic's).

OpenAI sends ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``,
``x-ratelimit-reset-requests`` and the same for tokens on every response, so clients
(the openai SDK's users, LiteLLM) pace themselves before they hit a 429; Anthropic's
Messages API sends ``anthropic-ratelimit-requests-limit`` etc., its reset as an RFC 3339
time. They are read after the request: what this key has used in the current minute,
across every web process (``RequestStore.rate_used``: one MGET, only for keys with a
limit). A key without limits gets none.
"""

from __future__ import annotations

from datetime import UTC, datetime

import redis
from flask import Flask, Response, current_app, g, request

from web.context import runner_of


def register(app: Flask) -> None:
    app.after_request(_headers)


def _headers(response: Response) -> Response:
    tenant = g.get("tenant")
    if tenant is None or not tenant.owner:
        return response
    runner = runner_of(current_app)
    rpm, tpm = runner.policy.rate(tenant.owner)
    if not (rpm or tpm):
        return response
    now = runner.clock()
    try:
        used_r, used_t = runner.store.rate_used(tenant.owner, now)
    except redis.RedisError:
        return response
    reset_s = 60 - now % 60
    anthropic = request.path.startswith("/v1/messages")
    for kind, limit, used in (("requests", rpm, used_r), ("tokens", tpm, used_t)):
        if not limit:
            continue
        left = str(max(limit - used, 0))
        if anthropic:
            at = datetime.fromtimestamp(now + reset_s, UTC).isoformat().replace("+00:00", "Z")
            response.headers[f"anthropic-ratelimit-{kind}-limit"] = str(limit)
            response.headers[f"anthropic-ratelimit-{kind}-remaining"] = left
            response.headers[f"anthropic-ratelimit-{kind}-reset"] = at
        else:
            response.headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            response.headers[f"x-ratelimit-remaining-{kind}"] = left
            response.headers[f"x-ratelimit-reset-{kind}"] = f"{round(reset_s, 3):g}s"
    return response
