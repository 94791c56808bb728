"""``GET /v1/streams/<request_id>`` frames a resumed stream as it was framed: chat and
Messages streams resume there; a Responses stream, whose events and ids it cannot
make, is a 400 that says where it resumes (``GET /v1/responses/{id}?stream=true``),
never a stream of chat chunks. Real Runner on a real redis-server; scripted output."""

from __future__ import annotations

import pytest
from flask.testing import FlaskClient

from app.settings import Settings
from tests.web.conftest import RequestIds, ScriptedOutput, delta, final, usage

pytestmark = pytest.mark.integration


def test_a_responses_stream_is_resumed_on_its_own_route_only(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput, settings: Settings
) -> None:
    rid = ids.peek()
    scripted.write(rid, delta(0, "Hello"), final(0), usage())
    body = {"model": settings.served_name, "input": "hi", "stream": True, "store": False}
    made = client.post("/v1/responses", json=body)
    assert made.status_code == 200 and "response.completed" in made.get_data(as_text=True)

    resumed = client.get(f"/v1/streams/{rid}")
    assert resumed.status_code == 400
    error = resumed.get_json()["error"]
    assert error["param"] == "request_id"
    assert f"/v1/responses/resp_{rid}?stream=true" in error["message"]
    assert "chat.completion.chunk" not in resumed.get_data(as_text=True)


def test_a_chat_stream_resumes_there(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput, settings: Settings
) -> None:
    rid = ids.peek()
    scripted.write(rid, delta(0, "Hello"), final(0), usage())
    body = {"model": settings.served_name, "messages": [{"role": "user", "content": "hi"}]}
    made = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert made.status_code == 200
    resumed = client.get(f"/v1/streams/{rid}")
    assert resumed.status_code == 200
    text = resumed.get_data(as_text=True)
    assert "chat.completion.chunk" in text and '"Hello"' in text
    assert text.endswith("data: [DONE]\n\n")
