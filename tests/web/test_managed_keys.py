"""API keys managed at run time and rate limits per key (issue 44), through the Flask
app on a real Redis: the admin API creates, lists, changes, rotates and revokes keys; a
managed key authenticates every API (Bearer, ``x-api-key``), a rotated secret fails and
the new one works, a revoked key is 401 at once; its open stream ends with an error.
Requests and tokens per minute are enforced in the admission script, 429 with OpenAI's
``x-ratelimit-*`` headers (Anthropic's on ``/v1/messages``), which every success to a
limited key carries too; an unused reservation is given back at the end."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from flask.testing import FlaskClient

from broker.api_keys import REFRESH_S
from broker.runner import Runner
from tests.web.conftest import ScriptedOutput, delta, final, usage

ADMIN = "admin-key-0123456789"
PLAIN = "plain-key-0123456789"

Make = Callable[..., tuple[FlaskClient, Runner]]


def within_one_minute(needed_s: float = 5.0) -> None:
    """Rate limits count per clock minute: start a test that needs ``needed_s`` where
    the minute will not turn during it."""
    left = 60 - time.time() % 60
    if left < needed_s:
        time.sleep(left + 0.05)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(client: FlaskClient, key: str, **extra: Any) -> Any:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, **extra}
    return client.post("/v1/chat/completions", json=body, headers=bearer(key))


def create(client: FlaskClient, **fields: Any) -> dict[str, Any]:
    resp = client.post("/admin/keys", json={"name": "team", **fields}, headers=bearer(ADMIN))
    assert resp.status_code == 201, resp.get_json()
    body: dict[str, Any] = resp.get_json()
    return body


def settle(seconds: float = REFRESH_S + 0.05) -> None:
    """Past the key cache's refresh interval: every process reads the change."""
    time.sleep(seconds)


@pytest.fixture
def keyed(make_client: Make) -> tuple[FlaskClient, Runner]:
    return make_client(api_keys=[ADMIN, PLAIN], admin_api_keys=[ADMIN])


def test_the_admin_api_manages_keys_and_only_admins_reach_it(
    keyed: tuple[FlaskClient, Runner],
) -> None:
    client, _runner = keyed
    key = create(client, weight=3, requests_per_minute=5)
    assert key["secret"].startswith("sk-tr-") and key["id"].startswith("key_")
    assert key["limits"] == {
        "weight": 3,
        "requests_per_minute": 5,
        "tokens_per_minute": 0,
        "max_in_flight": 0,
    }
    listed = client.get("/admin/keys", headers=bearer(ADMIN)).get_json()
    assert [k["id"] for k in listed["data"]] == [key["id"]]
    assert "secret" not in json.dumps(listed) and "sha256" not in json.dumps(listed)
    changed = client.patch(
        f"/admin/keys/{key['id']}", json={"tokens_per_minute": 900}, headers=bearer(ADMIN)
    ).get_json()
    assert changed["limits"]["tokens_per_minute"] == 900 and changed["limits"]["weight"] == 3
    # Not for a plain key, nor without a key, nor with a bad field.
    assert client.get("/admin/keys", headers=bearer(PLAIN)).status_code == 403
    assert client.get("/admin/keys").status_code == 401
    bad = client.post("/admin/keys", json={"weight": 0}, headers=bearer(ADMIN))
    assert bad.status_code == 400 and bad.get_json()["error"]["param"] == "weight"
    # The admin flag is a JSON boolean: "yes", "1" or 1 grant nothing, they are a 400;
    # so is a limit written as a string.
    for wrong in ({"admin": "yes"}, {"admin": "1"}, {"admin": 1}, {"weight": "5"}):
        bad = client.post("/admin/keys", json=wrong, headers=bearer(ADMIN))
        assert bad.status_code == 400, wrong
        assert bad.get_json()["error"]["param"] == next(iter(wrong))
        patched = client.patch(f"/admin/keys/{key['id']}", json=wrong, headers=bearer(ADMIN))
        assert patched.status_code == 400, wrong
    assert [
        k["admin"] for k in client.get("/admin/keys", headers=bearer(ADMIN)).get_json()["data"]
    ] == [False]
    assert client.get("/admin/keys/key_nope", headers=bearer(ADMIN)).status_code == 404


def test_an_open_server_has_no_admin_api(make_client: Make) -> None:
    client, _runner = make_client()
    resp = client.get("/admin/keys")
    assert resp.status_code == 403
    assert resp.get_json()["error"]["type"] == "permission_error"


def test_a_managed_key_authenticates_rotates_and_is_revoked(
    keyed: tuple[FlaskClient, Runner], scripted: ScriptedOutput
) -> None:
    client, _runner = keyed
    key = create(client)
    old = key["secret"]
    models = client.get("/v1/models", headers=bearer(old))
    assert models.status_code == 200
    assert client.get("/v1/models", headers={"x-api-key": old}).status_code == 200

    rotated = client.post(f"/admin/keys/{key['id']}/rotate", headers=bearer(ADMIN)).get_json()
    new = rotated["secret"]
    assert new != old and rotated["id"] == key["id"]
    settle()
    assert client.get("/v1/models", headers=bearer(old)).status_code == 401
    assert client.get("/v1/models", headers=bearer(new)).status_code == 200

    revoked = client.delete(f"/admin/keys/{key['id']}", headers=bearer(ADMIN))
    assert revoked.get_json() == {"object": "api_key.deleted", "id": key["id"], "deleted": True}
    settle()
    gone = client.get("/v1/models", headers=bearer(new))
    assert gone.status_code == 401 and gone.get_json()["error"]["type"] == "authentication_error"
    assert client.post(f"/admin/keys/{key['id']}/rotate", headers=bearer(ADMIN)).status_code == 404


def test_a_revoked_key_s_open_stream_ends_with_an_error(
    keyed: tuple[FlaskClient, Runner], scripted: ScriptedOutput
) -> None:
    client, _runner = keyed
    key = create(client)
    resp = chat(client, key["secret"], stream=True)
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    scripted.write(rid, delta(0, "Hello"))
    body = iter(resp.response)  # the SSE body, read as the client reads it
    seen = b""
    while b"Hello" not in seen:
        chunk = next(body)
        seen += chunk if isinstance(chunk, bytes) else chunk.encode()
    client.delete(f"/admin/keys/{key['id']}", headers=bearer(ADMIN))
    started = time.monotonic()
    rest = b"".join(c if isinstance(c, bytes) else c.encode() for c in body)
    took = time.monotonic() - started
    assert b"api_key_revoked" in rest and rest.endswith(b"data: [DONE]\n\n"), rest
    assert took < 2.0
    assert scripted.cancelled(rid)  # nobody may go on generating for a revoked key


def test_requests_per_minute_hold_with_headers_on_every_answer(
    keyed: tuple[FlaskClient, Runner], scripted: ScriptedOutput
) -> None:
    client, _runner = keyed
    key = create(client, requests_per_minute=2)
    within_one_minute()
    secret = key["secret"]
    for _ in range(2):
        resp = chat(client, secret, stream=True)
        assert resp.status_code == 200
        assert resp.headers["x-ratelimit-limit-requests"] == "2"
    refused = chat(client, secret, stream=True)
    assert refused.status_code == 429
    err = refused.get_json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "2 requests per minute" in err["message"]
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    assert 1 <= int(refused.headers["Retry-After"]) <= 61
    ok = client.get("/v1/models", headers=bearer(secret))
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    # Another key is not limited, and gets no headers.
    other = client.get("/v1/models", headers=bearer(PLAIN))
    assert "x-ratelimit-limit-requests" not in other.headers


def test_tokens_per_minute_reserve_and_give_back(
    keyed: tuple[FlaskClient, Runner], scripted: ScriptedOutput
) -> None:
    client, _runner = keyed
    key = create(client, tokens_per_minute=400)
    within_one_minute()
    secret = key["secret"]
    too_big = chat(client, secret, max_tokens=1000)
    assert too_big.status_code == 429
    assert "less than this request may use" in too_big.get_json()["error"]["message"]
    assert too_big.headers["x-ratelimit-limit-tokens"] == "400"

    resp = chat(client, secret, stream=True, max_tokens=300)
    assert resp.status_code == 200
    reserved = 400 - int(resp.headers["x-ratelimit-remaining-tokens"])
    assert reserved > 300  # the prompt and every max token
    rid = resp.headers["x-request-id"]
    scripted.write(rid, delta(0, "Hi"), final(0), usage(prompt=5, completion=2))
    b"".join(c if isinstance(c, bytes) else c.encode() for c in resp.response)
    resp.close()  # the run closes: its unused reservation goes back
    after = client.get("/v1/models", headers=bearer(secret))
    assert after.headers["x-ratelimit-remaining-tokens"] == str(400 - 7)
    # A second request fits again; a third of the same size does not.
    assert chat(client, secret, stream=True, max_tokens=300).status_code == 200
    assert chat(client, secret, stream=True, max_tokens=300).status_code == 429


def test_anthropic_clients_get_anthropic_rate_limit_headers(
    keyed: tuple[FlaskClient, Runner],
) -> None:
    client, runner = keyed
    key = create(client, requests_per_minute=1)
    within_one_minute()
    body = {
        "model": runner.model_name,
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
    }
    headers = {"x-api-key": key["secret"], "anthropic-version": "2023-06-01"}
    client.post("/v1/messages", json={**body, "stream": True}, headers=headers)
    refused = client.post("/v1/messages", json=body, headers=headers)
    assert refused.status_code == 429
    assert refused.headers["anthropic-ratelimit-requests-limit"] == "1"
    assert refused.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert refused.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert "x-ratelimit-limit-requests" not in refused.headers
