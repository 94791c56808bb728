"""Issue 16 line 4 ("one client takes all capacity: 400 chats on one WebSocket fill the
shared in-flight limit and k-beta gets 429; one request with 10,000 prompts x n=16 is
160,000 choices in one admission slot"), on the real admission path (Flask app, Runner,
the admission script on a real redis-server).

Requests started through ``Runner.start`` directly stand for a key's WebSocket chats:
the socket starts its requests there too, so HTTP and WebSocket share one quota.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flask.testing import FlaskClient

from app.intake import Endpoint
from broker.run import Run
from broker.runner import Runner
from tests.web.conftest import RequestIds, ScriptedOutput, delta, final, usage
from web.auth import key_owner

ALPHA, BETA = "k-alpha", "k-beta"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(content: str = "hi", **body: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **body}


def answer(scripted: ScriptedOutput, rid: str, choices: int = 1) -> None:
    """Write a finished output for ``rid`` before it is sent (readers start at 0-0)."""
    events = [ev for c in range(choices) for ev in (delta(c, "ok"), final(c))]
    scripted.write(rid, *events, usage())


def hold(runner: Runner, key: str, n: int = 1) -> Run:
    """A streaming chat of ``key`` left in flight (as one on its WebSocket)."""
    return runner.start(Endpoint.CHAT, chat(n=n), stream=True, owner=key_owner(key), route="/v1/ws")


def test_one_key_cannot_take_every_slot(
    make_client: Callable[..., tuple[FlaskClient, Runner]],
    scripted: ScriptedOutput,
    ids: RequestIds,
) -> None:
    client, runner = make_client(api_keys=[ALPHA, BETA], key_max_in_flight=3, max_queue=8)
    held = [hold(runner, ALPHA) for _ in range(3)]
    try:
        resp = client.post(CHAT, json=chat(), headers=auth(ALPHA))  # HTTP counts too
        assert resp.status_code == 429 and resp.headers["Retry-After"] == "1"
        assert resp.get_json()["error"] == {
            "message": "This API key already has 3 requests in flight, its quota "
            "(key_max_in_flight); retry when one has finished.",
            "type": "rate_limit_error",
            "param": None,
            "code": "quota_exceeded",
        }
        answer(scripted, ids.peek())
        resp = client.post(CHAT, json=chat(), headers=auth(BETA))  # another key is served
        assert resp.status_code == 200, resp.get_json()
        held.pop().close()  # one of alpha's ends: alpha may start one again
        answer(scripted, ids.peek())
        assert client.post(CHAT, json=chat(), headers=auth(ALPHA)).status_code == 200
    finally:
        for run in held:
            run.close()
    assert scripted.in_flight() == []


def test_without_keys_there_is_no_per_key_quota(
    make_client: Callable[..., tuple[FlaskClient, Runner]], scripted: ScriptedOutput
) -> None:
    _client, runner = make_client(key_max_in_flight=1, max_queue=8)
    held = [hold(runner, "") for _ in range(3)]
    for run in held:
        run.close()


def test_choices_are_counted_against_admission(
    make_client: Callable[..., tuple[FlaskClient, Runner]],
    scripted: ScriptedOutput,
    ids: RequestIds,
) -> None:
    client, runner = make_client(max_queue=8, max_request_choices=64)
    big = hold(runner, "", n=6)  # six of the eight choices
    try:
        resp = client.post(CHAT, json=chat(n=3))
        assert resp.status_code == 429 and resp.get_json()["error"]["code"] == "queue_full"
        answer(scripted, ids.peek(), choices=2)
        assert client.post(CHAT, json=chat(n=2)).status_code == 200  # 6 + 2 fit
    finally:
        big.close()
    # Nothing else in flight: a request larger than the limit still gets in (alone).
    answer(scripted, ids.peek(), choices=12)
    resp = client.post(COMPLETIONS, json={"prompt": ["a", "b", "c"], "n": 4})
    assert resp.status_code == 200 and len(resp.get_json()["choices"]) == 12


def test_choices_per_request_have_a_quota(
    make_client: Callable[..., tuple[FlaskClient, Runner]], scripted: ScriptedOutput
) -> None:
    client, _runner = make_client(max_request_choices=256)
    started = time.monotonic()
    resp = client.post(COMPLETIONS, json={"prompt": ["x"] * 10_000, "n": 16})
    assert time.monotonic() - started < 5.0
    assert resp.status_code == 429
    assert resp.get_json()["error"] == {
        "message": "This request asks for 160000 choices (prompts x n); the quota is 256 "
        "per request (max_request_choices).",
        "type": "rate_limit_error",
        "param": None,
        "code": "quota_exceeded",
    }
    assert scripted.in_flight() == []
