"""Issue 47 ("hostile clients II") where the finding needs a moment no client can pick:
the Flask app over a real redis-server, its output scripted (``ScriptedOutput``).

The rest of the issue's findings run through real processes in
``tests/e2e/test_hostile_clients_ii.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient

from app.intake import Endpoint
from app.messages import OutputKind
from app.settings import Settings
from broker.hub import REPLAY_ENTRIES, REPLAY_STREAMS
from broker.responses import ResponseStore
from broker.runner import Runner
from tests.web.conftest import RequestIds, ScriptedOutput, delta, final, usage

pytestmark = pytest.mark.integration

ALPHA, BETA = "k-alpha", "k-beta"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_stored_response_at_the_memory_limit_is_a_503_not_a_500(
    client: FlaskClient,
    ids: RequestIds,
    scripted: ScriptedOutput,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 4: Redis reaches ``maxmemory`` (noeviction) between the response's creation
    and its final object: the Lua check-and-set that stores it is refused with an OOM
    script error. The client gets the 503 + Retry-After of a full backbone, never a 500;
    once Redis has room again, reading the response settles it from its output."""
    rid = ids.peek()
    scripted.write(rid, delta(0, "stored"), final(0), usage())
    admin = redis.Redis.from_url(settings.redis_url)
    create = ResponseStore.create

    def create_then_fill(self: ResponseStore, stored: Any) -> None:
        create(self, stored)
        admin.config_set("maxmemory", 1)  # every write from now on: OOM

    monkeypatch.setattr(ResponseStore, "create", create_then_fill)
    try:
        resp = client.post("/v1/responses", json={"input": "hi", "store": True})
    finally:
        admin.config_set("maxmemory", 0)
    assert resp.status_code == 503, resp.get_data(as_text=True)
    assert resp.headers["Retry-After"]
    body = resp.get_json()["error"]
    assert body["code"] == "not_ready" and "Traceback" not in body["message"]

    got = client.get(f"/v1/responses/resp_{rid}")
    assert got.status_code == 200
    assert got.get_json()["status"] == "completed"
    assert got.get_json()["output"][0]["content"][0]["text"] == "stored"


def test_stream_followers_of_one_key_are_capped_per_worker(
    make_client: Callable[..., tuple[FlaskClient, Runner]],
    ids: RequestIds,
    scripted: ScriptedOutput,
) -> None:
    """Finding 6 (followers): 400 followers of one key's own live stream held 430 threads.
    A key holds at most ``key_max_connections`` followers (2 here); the next is a 429
    naming the quota, another key is not affected, and a closed follower frees its place."""
    client, runner = make_client(api_keys=[ALPHA, BETA], key_max_connections=2)
    rid = ids.peek()
    scripted.write(rid, delta(0, "live "))  # no end yet: the followers stay
    started = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers=auth(ALPHA),
        buffered=False,
    )
    assert started.status_code == 200
    follow = [
        client.get(f"/v1/streams/{rid}", headers=auth(ALPHA), buffered=False) for _ in range(2)
    ]
    assert [f.status_code for f in follow] == [200, 200]
    refused = client.get(f"/v1/streams/{rid}", headers=auth(ALPHA))
    assert refused.status_code == 429
    assert "key_max_connections" in refused.get_json()["error"]["message"]
    # Beta's own connections are its own (its request to alpha's stream is a 404).
    assert client.get(f"/v1/streams/{rid}", headers=auth(BETA)).status_code == 404
    follow.pop().close()
    again = client.get(f"/v1/streams/{rid}", headers=auth(ALPHA), buffered=False)
    assert again.status_code == 200
    for resp in (*follow, again, started):
        resp.close()
    runner.cancel(rid)


def test_stored_responses_count_against_a_per_key_byte_quota(
    make_client: Callable[..., tuple[FlaskClient, Runner]],
    ids: RequestIds,
    scripted: ScriptedOutput,
) -> None:
    """Finding 3: a 7 MB tool description under ``tool_choice: "none"`` (outside the
    prompt, so no context check) was stored for 30 days per request, and one key filled
    Redis. Stored responses now count against ``key_max_stored_bytes`` (300 KB here):
    past it a create is a 429 naming the quota before anything generates; another key
    is unaffected, and deleting frees the room."""
    client, _runner = make_client(api_keys=[ALPHA, BETA], key_max_stored_bytes=300_000)
    tool = {
        "type": "function",
        "name": "lookup",
        "description": "x" * 120_000,
        "parameters": {"type": "object", "properties": {}},
    }
    body = {"input": "hi", "tools": [tool], "tool_choice": "none", "store": True}

    def create(key: str) -> Any:
        scripted.write(ids.peek(), delta(0, "ok"), final(0), usage())
        return client.post("/v1/responses", json=body, headers=auth(key))

    first = create(ALPHA)
    assert first.status_code == 200, first.get_data(as_text=True)
    refused = create(ALPHA)  # the first holds its body twice (request echo, object)
    assert refused.status_code == 429
    assert "key_max_stored_bytes" in refused.get_json()["error"]["message"]
    assert create(BETA).status_code == 200  # another key's quota is its own
    rid = first.get_json()["id"]
    assert client.delete(f"/v1/responses/{rid}", headers=auth(ALPHA)).status_code == 200
    assert create(ALPHA).status_code == 200


def test_replays_are_read_in_bounded_pieces_under_the_stream_buffer(
    service: Runner,
    scripted: ScriptedOutput,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 7: replays of a finished 14 MB stream were read 256 checkpoints (up to
    16 MiB) at a time per reader, and 300 of them took a web process to 1.2 GB. Now a
    stream read from behind comes in pieces of at most ``REPLAY_ENTRIES`` entries, for
    at most ``REPLAY_STREAMS`` streams per read; a reader that takes nothing holds its
    buffer and no more; one that reads gets the whole stream, exactly."""
    rid = "long-finished-stream"
    text = "x" * 60_000
    for _ in range(120):  # 7.2 MB in 120 checkpoint entries
        scripted.write(rid, delta(0, text))
    scripted.write(rid, final(0), usage())
    hub = service.hub
    real = hub._read_pieces
    pieces_read: list[dict[str, int]] = []

    def spy(replays: dict[str, str], streams: dict[Any, Any]) -> Any:
        res, pieces = real(replays, streams)
        pieces_read.append({key: len(entries) for key, entries in pieces.items()})
        return res, pieces

    monkeypatch.setattr(hub, "_read_pieces", spy)
    prepared = service.intake.prepare(Endpoint.COMPLETIONS, {"prompt": "x"}, request_id=rid)
    stalled = [service.follow(prepared) for _ in range(20)]  # they never read
    reader = service.follow(prepared)
    got = []
    while not reader.ended:
        item = reader.next(5.0)
        assert item is not None, "the replay stalled"
        if item[1].kind is OutputKind.DELTA:
            got.append(item[1].text)
    assert "".join(got) == text * 120
    for run in stalled:
        assert run._sub.buffered <= settings.stream_buffer_bytes + len(text) + 1024
    assert pieces_read and all(
        len(read) <= REPLAY_STREAMS and max(read.values(), default=0) <= REPLAY_ENTRIES
        for read in pieces_read
    )
    for run in (*stalled, reader):
        run.close()
