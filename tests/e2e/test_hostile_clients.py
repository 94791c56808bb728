"""Issue 16 ("hostile clients") through real processes: redis-server, an echo worker, a
streamer, the batch driver and ``tokenrelay web`` under gunicorn, with
``api_keys=["k-alpha", "k-beta", "k-admin"]`` as the issue probed them. Each test
replays a numbered line of the issue and checks what a client gets now.

The Flask-level half (every route's 404 for another key, quotas, headers, limits) is
``tests/web/test_hostile_tenancy.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket

from tests.stack import Stack, stack_with, wait_for
from web.auth import key_owner

pytestmark = pytest.mark.e2e

ALPHA, BETA, ADMIN = "k-alpha", "k-beta", "k-admin"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    keys = {"api_keys": [ALPHA, BETA, ADMIN], "admin_api_keys": [ADMIN]}
    log_dir = tmp_path_factory.mktemp("hostile-logs")
    with stack_with(models_dir, log_dir, batcher=True, web_workers=1, web_threads=8, **keys) as st:
        yield st


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def upload(stack: Stack, key: str, content: bytes, name: str = "in.jsonl") -> dict[str, Any]:
    resp = requests.post(
        f"{stack.base_url}/v1/files",
        headers=auth(key),
        data={"purpose": "batch"},
        files={"file": (name, content)},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def wait_terminal(stack: Stack, key: str, batch_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        batch: dict[str, Any] = requests.get(
            f"{stack.base_url}/v1/batches/{batch_id}", headers=auth(key), timeout=10
        ).json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch['status']}\n{stack.logs()}"
        time.sleep(0.2)


def line(custom_id_json: str, text: str) -> bytes:
    """A request line whose custom_id is given as raw JSON (so it can hold an escape)."""
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 8})
    return (
        f'{{"custom_id": {custom_id_json}, "method": "POST", "url": "{CHAT}", "body": {body}}}'
    ).encode()


def test_a_batch_with_a_bom_and_a_lone_surrogate_id_completes_for_its_owner_only(
    stack: Stack,
) -> None:
    """Items 1, 6 and 11: a file that starts with a UTF-8 BOM and has a line whose
    ``custom_id`` is ``"\\ud800id"`` runs to ``completed`` (the id repaired to U+FFFD,
    line 1 not ``invalid_json``), in seconds; the output file is alpha's: beta gets 404
    for it, the admin key reads it."""
    content = b"\xef\xbb\xbf" + b"\n".join(
        [line('"first"', "bom line"), line('"\\ud800id"', "surrogate line")]
    )
    f = upload(stack, ALPHA, content)
    started = time.monotonic()
    resp = requests.post(
        f"{stack.base_url}/v1/batches",
        headers=auth(ALPHA),
        json={"input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    batch = wait_terminal(stack, ALPHA, resp.json()["id"], timeout=30)
    took = time.monotonic() - started
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert batch["error_file_id"] is None
    out_id = batch["output_file_id"]
    got = requests.get(f"{stack.base_url}/v1/files/{out_id}/content", headers=auth(ALPHA))
    assert got.status_code == 200
    lines = [json.loads(x) for x in got.text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["first", "\ufffdid"]
    texts = {
        x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in lines
    }
    assert texts == {"first": "bom line", "\ufffdid": "surrogate line"}
    print(f"BOM + surrogate batch completed in {took:.2f} s")

    # The results belong to the batch's owner.
    for path in (f"/v1/files/{out_id}", f"/v1/files/{out_id}/content"):
        assert requests.get(stack.base_url + path, headers=auth(BETA)).status_code == 404
    assert (
        requests.delete(f"{stack.base_url}/v1/files/{out_id}", headers=auth(BETA)).status_code
        == 404
    )
    listed = requests.get(f"{stack.base_url}/v1/files", headers=auth(BETA)).json()["data"]
    assert out_id not in [x["id"] for x in listed]
    admin = requests.get(f"{stack.base_url}/v1/files/{out_id}/content", headers=auth(ADMIN))
    assert admin.status_code == 200 and admin.text == got.text

    # Its lines' usage is alpha's too (they ran as no key's before: ``owner`` unset).
    def batch_requests(key: str) -> int:
        usage = requests.get(
            f"{stack.base_url}/admin/usage",
            params={"api": "batch", "key": key_owner(key)},
            headers=auth(ADMIN),
            timeout=10,
        ).json()
        return int(usage["totals"]["requests"])

    wait_for(lambda: batch_requests(ALPHA) == 2, 10, "alpha's batch lines in the ledger")
    assert batch_requests(BETA) == 0


def test_a_non_ascii_filename_downloads(stack: Stack) -> None:
    """Item 10: ``数据.jsonl`` uploads and its content downloads (200 through gunicorn,
    which refused the raw name as a header: 500 before)."""
    f = upload(stack, ALPHA, b'{"a": 1}\n', name="数据.jsonl")
    resp = requests.get(f"{stack.base_url}/v1/files/{f['id']}/content", headers=auth(ALPHA))
    assert resp.status_code == 200
    assert resp.content == b'{"a": 1}\n'
    assert resp.headers["Content-Disposition"] == (
        "attachment; filename=\"__.jsonl\"; filename*=UTF-8''%E6%95%B0%E6%8D%AE.jsonl"
    )


@pytest.mark.parametrize("depth", [490, 980])
def test_deep_nesting_with_a_surrogate_is_a_400_over_http(stack: Stack, depth: int) -> None:
    """Item 7 over HTTP: 400 with our message (was 500 and a 167 KB traceback)."""
    body = '{"x":"\\ud800","y":' + "[" * depth + "]" * depth + "}"
    resp = requests.post(
        f"{stack.base_url}{CHAT}",
        data=body,
        headers={**auth(ALPHA), "Content-Type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "The request body is nested too deeply (at most 128 levels)."
    )


def test_deep_nesting_with_a_surrogate_is_an_error_message_on_the_websocket(
    stack: Stack,
) -> None:
    """Item 7 on the WebSocket: an error message, and the socket still answers (the
    server wrote ``HTTP/1.1 500`` into the open socket before)."""
    url = stack.base_url.replace("http://", "ws://") + "/v1/ws"
    ws = websocket.create_connection(url, timeout=10, header=[f"Authorization: Bearer {ALPHA}"])
    try:
        for depth in (490, 980):
            ws.send('{"type":"chat","id":"a","x":"\\ud800","y":' + "[" * depth + "]" * depth + "}")
            reply = json.loads(ws.recv())
            assert reply["type"] == "error", reply
            assert reply["error"]["code"] == "invalid_json"
            assert reply["error"]["message"] == (
                "The request body is nested too deeply (at most 128 levels)."
            )
        ws.send(json.dumps({"type": "ping", "id": "p"}))
        assert json.loads(ws.recv()) == {"type": "pong", "id": "p"}
    finally:
        ws.close()


def test_stop_token_ids_count_is_limited(stack: Stack) -> None:
    """Item 8: 10^6 stop_token_ids is a 400 naming the field (was accepted and kept)."""
    resp = requests.post(
        f"{stack.base_url}{CHAT}",
        headers=auth(ALPHA),
        json={"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [1] * 10**6},
        timeout=30,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "stop_token_ids"


def test_the_chat_page_sends_security_headers(stack: Stack) -> None:
    """Item 13: CSP, nosniff and X-Frame-Options on the page and its files."""
    for path in ("/", "/static/app.js"):
        resp = requests.get(stack.base_url + path, timeout=10)
        assert resp.status_code == 200
        assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert resp.headers["X-Frame-Options"] == "DENY"
