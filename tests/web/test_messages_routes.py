"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` over HTTP: the count is the
prompt the request builds, and the non-streamed message names its request as the
streamed one does (``request-id``). Real Runner on a real redis-server; the output is
scripted."""

from __future__ import annotations

from typing import Any

import pytest
from flask.testing import FlaskClient

from app.intake import Endpoint
from app.settings import Settings
from broker.runner import Runner
from tests.web.conftest import RequestIds, ScriptedOutput, delta, final, usage

pytestmark = pytest.mark.integration


TOOLS = [
    {
        "name": "get_weather",
        "description": "weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def message_body(settings: Settings, **kw: Any) -> dict[str, Any]:
    return {
        "model": settings.served_name,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        **kw,
    }


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": TOOLS, "tool_choice": {"type": "none"}},
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}},
        {"output_config": {"effort": "low"}},
        {"thinking": {"type": "disabled"}, "system": "Be brief."},
    ],
)
def test_count_tokens_is_the_prompt_the_message_request_builds(
    client: FlaskClient, service: Runner, settings: Settings, extra: dict[str, Any]
) -> None:
    body = message_body(settings, **extra)
    resp = client.post("/v1/messages/count_tokens", json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    prepared = service.prepare(Endpoint.MESSAGES, {**body, "max_tokens": 1})
    assert resp.get_json() == {"input_tokens": len(prepared.record.prompts[0])}


def test_count_tokens_without_the_tools_tool_choice_none_leaves_out(
    client: FlaskClient, settings: Settings
) -> None:
    def count(**kw: Any) -> int:
        resp = client.post("/v1/messages/count_tokens", json=message_body(settings, **kw))
        n: int = resp.get_json()["input_tokens"]
        return n

    assert count(tools=TOOLS, tool_choice={"type": "none"}) == count() < count(tools=TOOLS)


def test_a_non_streamed_message_names_its_request_as_a_stream_does(
    client: FlaskClient, ids: RequestIds, scripted: ScriptedOutput, settings: Settings
) -> None:
    """``request-id`` (the anthropic SDK's ``_request_id``, what ``GET
    /v1/streams/<id>`` takes) on the JSON answer too, not only on the event stream."""
    rid = ids.peek()
    scripted.write(rid, delta(0, "Hi"), final(0), usage())
    resp = client.post("/v1/messages", json=message_body(settings, max_tokens=4))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.headers["request-id"] == rid
    assert resp.get_json()["id"] == f"msg_{rid}"
