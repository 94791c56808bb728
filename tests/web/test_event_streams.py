"""How a stream of named events ends (``web.sse.event_stream``: Anthropic's Messages
and OpenAI's Responses): with a hand-over frame when this process hands its streams
over, and with an error event in the API's own shape when reading fails, never cut off
without a last frame. Real Runner on a real redis-server; the output is scripted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient

from app.settings import Settings
from broker import drive
from broker.runner import Runner
from tests.web.conftest import RequestIds, ScriptedOutput, delta
from web import sse

pytestmark = pytest.mark.integration

APIS = {
    "messages": (
        "/v1/messages",
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    ),
    "responses": ("/v1/responses", {"input": "hi"}),
}


def _events(body: str) -> list[tuple[str | None, Any]]:
    """(event name, data) of each data-carrying frame."""
    out: list[tuple[str | None, Any]] = []
    for block in body.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event"), json.loads(lines["data"])))
    return out


@pytest.mark.parametrize("api", sorted(APIS))
def test_a_stream_handed_over_ends_with_the_hand_over_frame(
    api: str,
    client: FlaskClient,
    ids: RequestIds,
    scripted: ScriptedOutput,
    service: Runner,
    settings: Settings,
) -> None:
    route, body = APIS[api]
    body = {**body, "model": settings.served_name}
    scripted.write(ids.peek(), delta(0, "partial"))
    resp = client.post(route, json={**body, "stream": True}, buffered=False)
    assert resp.status_code == 200
    service.closing.set()  # this process hands its streams over (drain time up)
    try:
        text = resp.get_data(as_text=True)
    finally:
        service.closing.clear()
        resp.close()
    assert text.endswith(sse.HANDED_OVER)
    assert "partial" in text  # what was there before the hand-over was written
    assert all(name != "error" and "error" not in data for name, data in _events(text))


@pytest.mark.parametrize("api", sorted(APIS))
def test_a_read_that_fails_ends_the_stream_with_the_api_s_error_event(
    api: str,
    client: FlaskClient,
    ids: RequestIds,
    scripted: ScriptedOutput,
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
) -> None:
    route, body = APIS[api]
    body = {**body, "model": settings.served_name}
    rid = ids.peek()
    scripted.write(rid, delta(0, "partial"))

    def failing(run: Any, keepalive_s: float, first: Any = None, pump: Any = None) -> Iterator[Any]:
        if first:
            yield first  # what the opening read, then Redis is gone
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr(drive, "reads", failing)
    resp = client.post(route, json={**body, "stream": True})
    text = resp.get_data(as_text=True)
    resp.close()
    name, last = _events(text)[-1]
    # Redis away is the 503 it is (retry), in each API's own error shape.
    if api == "messages":
        assert name == "error"
        assert last["type"] == "error" and last["error"]["type"] == "overloaded_error"
    else:
        assert last["error"]["type"] == "service_unavailable_error"
    assert "partial" in text
    assert scripted.cancelled(rid)  # the run was closed with the error
