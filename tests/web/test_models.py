"""Many models behind one front door (issue 41), at the web tier: a request goes to the
model it names, prepared with that model's card and sent to its queues; aliases are
served by their model and reported as asked; unknown models are 404, known ones with no
live worker 503 at once or, with ``model_wait_s``, queued; /v1/models and /ready list
every live model. Workers are registry entries and their model entries, as their
heartbeats write them; output is scripted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from broker.keys import Keys
from broker.requests import RequestStore
from tests.web.conftest import RequestIds, ScriptedOutput, delta, final, usage

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(model: str | None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], **kw}
    if model is not None:
        body["model"] = model
    return body


def stored_model(svc: Any, rid: str) -> str:
    loaded = RequestStore(svc.redis, Keys(svc.settings.key_prefix)).load(rid)
    assert loaded is not None
    return str(loaded[0].model)


def queued_on(svc: Any) -> dict[str, int]:
    from broker.celery_app import queue_depths

    return {q: n for m in svc.models.known() for q, n in queue_depths(svc.redis, m).items() if n}


@pytest.fixture
def two(
    make_client: Callable[..., tuple[FlaskClient, Any]], fleet: Any, bundled_model_dir: Path
) -> tuple[FlaskClient, Any]:
    """The fleet's model (the default) and ``model-b``, a second model with a live worker;
    ``gpt-4o-mini`` an alias of ``model-b``."""
    fleet.serve("model-b", bundled_model_dir)
    return make_client(model_aliases={"gpt-4o-mini": "model-b"})


def test_a_request_goes_to_the_model_it_names_and_its_queues(
    two: tuple[FlaskClient, Any], ids: RequestIds, scripted: ScriptedOutput, fleet: Any
) -> None:
    client, svc = two
    before = queued_on(svc)  # Celery's queue names are the same for every test
    for model in ("model-b", fleet.worker.model, None):
        rid = ids.peek()
        scripted.write(rid, delta(0, "ok"), final(0), usage())
        resp = client.post(CHAT, json=chat(model))
        assert resp.status_code == 200, resp.get_json()
        served = model or fleet.worker.model  # no model: the default one
        assert resp.get_json()["model"] == served
        assert stored_model(svc, rid) == served
    # Each one's generate task waits in its own model's queue (no worker consumes here).
    added = {q: n - before.get(q, 0) for q, n in queued_on(svc).items()}
    assert added == {"tr.interactive.model-b": 1, f"tr.interactive.{fleet.worker.model}": 2}


def test_an_alias_is_served_by_its_model_and_reported_as_asked(
    two: tuple[FlaskClient, Any], ids: RequestIds, scripted: ScriptedOutput
) -> None:
    client, svc = two
    rid = ids.peek()
    scripted.write(rid, delta(0, "ok"), final(0), usage())
    resp = client.post(COMPLETIONS, json={"model": "gpt-4o-mini", "prompt": "hi"})
    assert resp.status_code == 200
    assert resp.get_json()["model"] == "gpt-4o-mini"
    assert stored_model(svc, rid) == "model-b"


def test_unknown_models_are_404_and_known_ones_without_a_worker_503_at_once(
    two: tuple[FlaskClient, Any], fleet: Any
) -> None:
    client, svc = two
    resp = client.post(CHAT, json=chat("no-such-model"))
    assert resp.status_code == 404 and resp.get_json()["error"]["code"] == "model_not_found"
    # A body wrong in itself says so first, whatever its model.
    assert client.post(CHAT, json={"model": "no-such-model"}).status_code == 400
    fleet.workers.unregister("w-model-b")  # model-b's only worker is gone; its entry stays
    svc.models._live = (float("-inf"), {})  # read the registry again now
    resp = client.post(CHAT, json=chat("model-b"))
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert "No live worker serves model 'model-b'" in resp.get_json()["error"]["message"]
    # The default model is untouched.
    assert client.get("/ready").status_code == 200
    assert client.get("/ready?model=model-b").status_code == 503


def test_with_model_wait_a_request_for_a_model_without_workers_is_queued(
    make_client: Callable[..., tuple[FlaskClient, Any]],
    fleet: Any,
    bundled_model_dir: Path,
    ids: RequestIds,
    scripted: ScriptedOutput,
) -> None:
    fleet.serve("model-b", bundled_model_dir)
    fleet.workers.unregister("w-model-b")  # scaled to zero: known, no worker
    client, svc = make_client(model_wait_s=30.0)
    before = queued_on(svc).get("tr.interactive.model-b", 0)
    rid = ids.peek()
    scripted.write(rid, delta(0, "late"), final(0), usage())  # as its first worker would
    resp = client.post(CHAT, json=chat("model-b"))
    assert resp.status_code == 200 and resp.get_json()["choices"][0]["message"]["content"] == "late"
    assert queued_on(svc)["tr.interactive.model-b"] == before + 1
    # Unknown stays unknown.
    assert client.post(CHAT, json=chat("model-c")).status_code == 404


def test_models_lists_every_live_model_and_its_aliases(
    two: tuple[FlaskClient, Any], fleet: Any
) -> None:
    client, _svc = two
    data = client.get("/v1/models").get_json()["data"]
    by_id = {m["id"]: m for m in data}
    assert list(by_id) == [fleet.worker.model, "model-b", "gpt-4o-mini"]
    assert by_id["gpt-4o-mini"]["root"] == "model-b" and by_id["model-b"]["root"] == "model-b"
    assert by_id["model-b"]["engines"] == ["scripted"]
    assert by_id["model-b"]["max_model_len"] == 8192
    assert client.get("/v1/models/gpt-4o-mini").get_json() == by_id["gpt-4o-mini"]
    ready = client.get("/ready?model=gpt-4o-mini").get_json()
    assert ready["model"] == "model-b" and [w["worker_id"] for w in ready["workers"]] == [
        "w-model-b"
    ]
    assert ready["models"]["model-b"] == {"ready": True, "workers": 1}
    fleet.workers.unregister("w-model-b")
    _svc.models._live = (float("-inf"), {})
    assert "model-b" not in {m["id"] for m in client.get("/v1/models").get_json()["data"]}
    assert client.get("/v1/models/model-b").status_code == 404
