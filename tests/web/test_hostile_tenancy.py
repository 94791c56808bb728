"""Issue 16 against the web tier (real Flask app, real Runner, real redis-server).

Item 1 ("keys share everything"): with keys configured, a key sees, downloads, deletes,
cancels and builds batches from only its own files and batches; everything else is 404,
exactly as an id that does not exist. An admin key sees all; with no keys configured
nothing changes. Per-key file quotas answer 429 naming the quota. Also items 7 (deep
nesting with a lone surrogate), 8 (stop_token_ids count), 10 (non-ASCII filenames) and
13 (security headers on the chat page) at the HTTP layer. The same lines through real
processes (gunicorn, the batch driver, a real WebSocket) are in
``tests/e2e/test_hostile_clients.py``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient

from app.settings import Settings
from broker.files import FileQuota, FileStore
from broker.keys import Keys
from broker.runner import Runner
from tests.web.conftest import RequestIds
from web.app import create_app
from web.auth import key_owner
from web.batch import content_disposition

ALPHA, BETA, ADMIN = "k-alpha", "k-beta", "k-admin"
CHAT = "/v1/chat/completions"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def make_client(settings: Settings, ids: RequestIds, fleet: Any) -> Callable[..., FlaskClient]:
    def make(**overrides: Any) -> FlaskClient:
        s = settings.model_copy(update=overrides)
        flask_app = create_app(s, runner=Runner(s, new_id=ids))
        flask_app.testing = True
        return flask_app.test_client()

    return make


@pytest.fixture
def keyed(make_client: Callable[..., FlaskClient]) -> FlaskClient:
    return make_client(api_keys=[ALPHA, BETA, ADMIN], admin_api_keys=[ADMIN])


def upload(
    client: FlaskClient, key: str | None, content: bytes = b"{}\n", name: str = "in.jsonl"
) -> Any:
    return client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(content), name)},
        headers=auth(key) if key else {},
        content_type="multipart/form-data",
    )


def new_batch(client: FlaskClient, key: str | None, file_id: str) -> Any:
    return client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"},
        headers=auth(key) if key else {},
    )


def error_of(resp: Any) -> dict[str, Any]:
    body: dict[str, Any] = resp.get_json()["error"]
    return body


# -- item 1: per-key ownership ---------------------------------------------------------


def test_another_key_gets_404_for_everything_of_alpha(keyed: FlaskClient) -> None:
    """Issue 16.1 line by line: with k-beta, alpha's file is not listed, its content and
    metadata are 404, deleting it is 404, a batch over it is 404; alpha's batch is not
    listed, GET and cancel are 404 (and the batch is not cancelled)."""
    f = upload(keyed, ALPHA, b'{"secret": "alpha prompts"}\n').get_json()
    batch = new_batch(keyed, ALPHA, f["id"]).get_json()
    assert batch["status"] == "validating"

    listed = keyed.get("/v1/files", headers=auth(BETA)).get_json()
    assert f["id"] not in [x["id"] for x in listed["data"]]
    for path in (f"/v1/files/{f['id']}", f"/v1/files/{f['id']}/content"):
        resp = keyed.get(path, headers=auth(BETA))
        assert resp.status_code == 404, path
        assert error_of(resp)["message"] == f"No such File object: {f['id']}"
        assert b"alpha prompts" not in resp.data
    assert keyed.delete(f"/v1/files/{f['id']}", headers=auth(BETA)).status_code == 404
    resp = new_batch(keyed, BETA, f["id"])
    assert resp.status_code == 404 and error_of(resp)["param"] == "input_file_id"

    batches = keyed.get("/v1/batches", headers=auth(BETA)).get_json()
    assert batch["id"] not in [x["id"] for x in batches["data"]]
    assert keyed.get(f"/v1/batches/{batch['id']}", headers=auth(BETA)).status_code == 404
    resp = keyed.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(BETA))
    assert resp.status_code == 404
    assert error_of(resp)["message"] == f"No such Batch object: {batch['id']}"

    # Alpha still has all of it, untouched.
    mine = keyed.get(f"/v1/batches/{batch['id']}", headers=auth(ALPHA)).get_json()
    assert mine["status"] == "validating"
    assert keyed.get(f"/v1/files/{f['id']}/content", headers=auth(ALPHA)).data == (
        b'{"secret": "alpha prompts"}\n'
    )
    assert f["id"] in [x["id"] for x in keyed.get("/v1/files", headers=auth(ALPHA)).json["data"]]
    assert batch["id"] in [
        x["id"] for x in keyed.get("/v1/batches", headers=auth(ALPHA)).json["data"]
    ]
    # Alpha's own cancel and delete work.
    resp = keyed.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(ALPHA))
    assert resp.status_code == 200 and resp.json["status"] == "cancelling"
    assert keyed.delete(f"/v1/files/{f['id']}", headers=auth(ALPHA)).json["deleted"] is True


def test_an_admin_key_sees_and_manages_every_key(keyed: FlaskClient) -> None:
    f = upload(keyed, ALPHA).get_json()
    batch = new_batch(keyed, ALPHA, f["id"]).get_json()
    assert f["id"] in [x["id"] for x in keyed.get("/v1/files", headers=auth(ADMIN)).json["data"]]
    assert batch["id"] in [
        x["id"] for x in keyed.get("/v1/batches", headers=auth(ADMIN)).json["data"]
    ]
    assert keyed.get(f"/v1/files/{f['id']}/content", headers=auth(ADMIN)).data == b"{}\n"
    resp = keyed.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(ADMIN))
    assert resp.json["status"] == "cancelling"
    # What the admin creates is its own: beta does not see it.
    own = upload(keyed, ADMIN).get_json()
    assert keyed.get(f"/v1/files/{own['id']}", headers=auth(BETA)).status_code == 404
    assert keyed.delete(f"/v1/files/{f['id']}", headers=auth(ADMIN)).status_code == 200


def test_redis_holds_a_hash_of_the_key_never_the_key(
    keyed: FlaskClient, settings: Settings
) -> None:
    f = upload(keyed, ALPHA).get_json()
    batch = new_batch(keyed, ALPHA, f["id"]).get_json()
    client = redis.Redis.from_url(settings.redis_url)
    keys = Keys(settings.key_prefix)
    for key in (keys.file(f["id"]), keys.batch(batch["id"])):
        stored = client.hgetall(key)
        assert stored[b"owner"] == key_owner(ALPHA).encode()
        assert not any(ALPHA.encode() in v for v in stored.values())


def test_without_keys_everything_is_shared_as_before(
    make_client: Callable[..., FlaskClient],
) -> None:
    client = make_client()
    f = upload(client, None).get_json()
    batch = new_batch(client, None, f["id"]).get_json()
    other = make_client()  # another "client": there are no tenants without keys
    assert f["id"] in [x["id"] for x in other.get("/v1/files").json["data"]]
    assert other.get(f"/v1/batches/{batch['id']}").status_code == 200
    assert other.get(f"/v1/files/{f['id']}/content").data == b"{}\n"


def test_admin_keys_must_be_api_keys(settings: Settings) -> None:
    with pytest.raises(
        ValueError, match="ADMIN_API_KEYS must also be listed in TOKENRELAY_API_KEYS"
    ):
        Settings(**{**settings.model_dump(), "api_keys": [ALPHA], "admin_api_keys": [ADMIN]})


# -- quotas per key ------------------------------------------------------------------------


def test_file_count_quota_is_429_naming_it(make_client: Callable[..., FlaskClient]) -> None:
    client = make_client(api_keys=[ALPHA, BETA], key_max_files=3)
    made = [upload(client, ALPHA).get_json()["id"] for _ in range(3)]
    resp = upload(client, ALPHA)
    assert resp.status_code == 429
    err = error_of(resp)
    assert err["type"] == "rate_limit_error" and err["code"] == "quota_exceeded"
    assert "key_max_files" in err["message"] and "3 files" in err["message"]
    assert "Retry-After" not in resp.headers
    assert upload(client, BETA).status_code == 200  # beta's quota is its own
    assert client.delete(f"/v1/files/{made[0]}", headers=auth(ALPHA)).status_code == 200
    assert upload(client, ALPHA).status_code == 200  # deleting frees the quota


def test_file_bytes_quota_is_429_naming_it(make_client: Callable[..., FlaskClient]) -> None:
    client = make_client(api_keys=[ALPHA], key_max_file_bytes=10_000)
    assert upload(client, ALPHA, b"x" * 6000).status_code == 200
    resp = upload(client, ALPHA, b"x" * 6000)
    assert resp.status_code == 429
    err = error_of(resp)
    assert err["code"] == "quota_exceeded" and "key_max_file_bytes" in err["message"]
    assert "6000 bytes" in err["message"] and "10000" in err["message"]
    assert upload(client, ALPHA, b"x" * 4000).status_code == 200


def test_expired_files_stop_counting(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    keys = Keys(settings.key_prefix + "quota-expiry:")
    files = FileStore(client, keys, ttl_s=600, quota=FileQuota(max_files=1))
    first = files.create(filename="a", purpose="batch", content=b"a", now=1.0, owner="o")
    client.delete(keys.file(first.id), keys.file_data(first.id))  # as its TTL would
    files.create(filename="b", purpose="batch", content=b"b", now=2.0, owner="o")
    assert client.hkeys(keys.owner_file_bytes("o")) != [first.id.encode()]
    assert len(client.hkeys(keys.owner_file_bytes("o"))) == 1


# -- item 3 (part): downloads stream ---------------------------------------------------


def test_a_download_is_read_in_chunks(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    files = FileStore(client, Keys(settings.key_prefix), ttl_s=600)
    content = bytes(range(256)) * 41  # 10,496 bytes: 11 chunks of 1,000
    obj = files.create(filename="big", purpose="batch", content=content, now=1.0)
    pieces = list(files.chunks(obj.id, obj.bytes, chunk=1000))
    assert [len(p) for p in pieces] == [1000] * 10 + [496]
    assert b"".join(pieces) == content


def test_download_route_streams_with_its_length(keyed: FlaskClient) -> None:
    content = b"line\n" * 50_000
    f = upload(keyed, ALPHA, content).get_json()
    resp = keyed.get(f"/v1/files/{f['id']}/content", headers=auth(ALPHA), buffered=False)
    assert resp.is_streamed
    assert resp.headers["Content-Length"] == str(len(content))
    assert b"".join(resp.response) == content


# -- item 10: non-ASCII filenames --------------------------------------------------------


def test_non_ascii_filename_is_rfc_5987(keyed: FlaskClient) -> None:
    f = upload(keyed, ALPHA, name="数据.jsonl").get_json()
    assert f["filename"] == "数据.jsonl"
    resp = keyed.get(f"/v1/files/{f['id']}/content", headers=auth(ALPHA))
    assert resp.status_code == 200
    assert resp.headers["Content-Disposition"] == (
        "attachment; filename=\"__.jsonl\"; filename*=UTF-8''%E6%95%B0%E6%8D%AE.jsonl"
    )


@pytest.mark.parametrize(
    ("name", "header"),
    [
        ("plain.jsonl", 'attachment; filename="plain.jsonl"'),
        ('a"b\\c.jsonl', "attachment; filename=\"a_b_c.jsonl\"; filename*=UTF-8''a%22b%5Cc.jsonl"),
        ("é", "attachment; filename=\"_\"; filename*=UTF-8''%C3%A9"),
        ("", "attachment; filename=\"download\"; filename*=UTF-8''"),
    ],
)
def test_content_disposition(name: str, header: str) -> None:
    assert content_disposition(name) == header
    header.encode("latin-1")  # what a WSGI server accepts in a header


# -- item 7: deep nesting with a lone surrogate ------------------------------------------


@pytest.mark.parametrize("depth", [490, 980, 5000])
def test_deep_nesting_with_a_lone_surrogate_is_a_400(client: FlaskClient, depth: int) -> None:
    body = '{"x":"\\ud800","y":' + "[" * depth + "]" * depth + "}"
    resp = client.post(CHAT, data=body, content_type="application/json")
    assert resp.status_code == 400
    assert error_of(resp)["message"] == (
        "The request body is nested too deeply (at most 128 levels)."
    )


# -- item 8: stop_token_ids count ------------------------------------------------------------


def test_stop_token_ids_has_a_count_limit(make_client: Callable[..., FlaskClient]) -> None:
    client = make_client(max_stop_token_ids=64)
    messages = [{"role": "user", "content": "hi"}]
    resp = client.post(CHAT, json={"messages": messages, "stop_token_ids": list(range(10**6))})
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["param"] == "stop_token_ids"
    assert err["message"] == "'stop_token_ids' may hold at most 64 ids (got 1000000)."
    resp = client.post(CHAT, json={"messages": messages, "stop_token_ids": list(range(65))})
    assert resp.status_code == 400 and error_of(resp)["param"] == "stop_token_ids"


# -- item 13: security headers on the chat page ------------------------------------------


def test_chat_page_and_static_files_carry_security_headers(client: FlaskClient) -> None:
    for path in ("/", "/static/app.js", "/static/style.css"):
        resp = client.get(path)
        assert resp.status_code == 200, path
        csp = resp.headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, path
        assert resp.headers["X-Content-Type-Options"] == "nosniff", path
        assert resp.headers["X-Frame-Options"] == "DENY", path
        resp.close()
    # API answers are not pages: no CSP there.
    assert "Content-Security-Policy" not in client.get("/health").headers


def test_json_body_is_unchanged(keyed: FlaskClient) -> None:
    """A file's metadata answer still has OpenAI's shape (no owner field leaks)."""
    f = upload(keyed, ALPHA).get_json()
    assert set(f) == {
        "id",
        "object",
        "bytes",
        "created_at",
        "filename",
        "purpose",
        "status",
        "expires_at",
        "status_details",
    }
    assert json.dumps(f).find(key_owner(ALPHA)) == -1
