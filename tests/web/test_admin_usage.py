"""``GET /admin/usage`` and the usage metrics (issue 44) on the real Flask app and a real
redis-server: the ledger's rows and totals, filtered by key (owner or its 16-character
prefix), model, API and period; admin keys only when keys are configured (403 in the
OpenAI error shape), anyone on an open server; bad or too wide ranges are 400; the
all-time counters at /metrics, labelled by key prefix (never a secret), bounded."""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient

from app.messages import OutputEvent, OutputKind
from app.settings import Settings
from app.usage import UsageCount
from broker.keys import Keys
from broker.outputs import OutputEntry, OutputStreams
from broker.runner import Runner
from web.auth import key_owner
from web.usage_metrics import usage_families

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
AT = calendar.timegm((2026, 3, 10, 14, 30, 0))
KEY, ADMIN = "sk-user-1", "sk-admin-1"


def count(owner: str, model: str = "m", api: str = CHAT, at: float = AT, **kw: Any) -> UsageCount:
    values: dict[str, Any] = {
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "completion_tokens": 5,
        "error": False,
    }
    values.update(kw)
    return UsageCount(owner=owner, model=model, api=api, at=at, **values)


def end(settings: Settings, *counts: UsageCount) -> None:
    """Each count as a request's end, written as a streamer writes it."""
    client = redis.Redis.from_url(settings.redis_url)
    try:
        outputs = OutputStreams(client, Keys(settings.key_prefix))
        for i, c in enumerate(counts):
            ev = OutputEvent(OutputKind.USAGE, usage={"prompt_tokens": c.prompt_tokens})
            outputs.write([OutputEntry(f"r{i}-{time.time()}", [ev], "1", first=True, usage=c)])
    finally:
        client.close()


def test_rows_and_totals_on_an_open_server(client: FlaskClient, settings: Settings) -> None:
    end(
        settings,
        count("", cached_tokens=4),
        count("", completion_tokens=7),
        count("", api="batch", error=True, completion_tokens=0),
        count("", at=AT - 86400),
        count("", model="other"),
    )
    resp = client.get("/admin/usage?from=2026-03-09&to=2026-03-10")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    body = resp.get_json()
    assert body["granularity"] == "day" and (body["from"], body["to"]) == (
        "2026-03-09",
        "2026-03-10",
    )
    rows = {(r["period"], r["model"], r["api"]): r for r in body["data"]}
    assert rows[("2026-03-10", "m", CHAT)] == {
        "key": "",
        "model": "m",
        "api": CHAT,
        "period": "2026-03-10",
        "requests": 2,
        "prompt_tokens": 20,
        "cached_tokens": 4,
        "completion_tokens": 12,
        "errors": 0,
    }
    assert rows[("2026-03-10", "m", "batch")]["errors"] == 1
    assert rows[("2026-03-09", "m", CHAT)]["requests"] == 1
    assert body["totals"]["requests"] == 5 and body["totals"]["prompt_tokens"] == 50

    only = client.get("/admin/usage?from=2026-03-10&to=2026-03-10&model=m&api=batch").get_json()
    assert [r["api"] for r in only["data"]] == ["batch"] and only["totals"]["requests"] == 1

    hourly = client.get(
        "/admin/usage?granularity=hour&from=2026-03-10T13&to=2026-03-10T15"
    ).get_json()
    assert {r["period"] for r in hourly["data"]} == {"2026-03-10T14"}
    assert hourly["totals"]["requests"] == 4


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("from=2026-3-1x", "from"),
        ("to=tomorrow", "to"),
        ("from=2024-01-01&to=2026-03-10", "from"),
        ("granularity=hour&from=2026-01-01&to=2026-03-01", "from"),
        ("granularity=week", "granularity"),
    ],
)
def test_bad_ranges_are_400(client: FlaskClient, query: str, param: str) -> None:
    resp = client.get(f"/admin/usage?{query}")
    assert resp.status_code == 400
    error = resp.get_json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_only_admin_keys_read_it(
    make_client: Callable[..., tuple[FlaskClient, Runner]], settings: Settings
) -> None:
    client, _runner = make_client(api_keys=[KEY, ADMIN], admin_api_keys=[ADMIN])
    mine, theirs = key_owner(KEY), key_owner(ADMIN)
    end(settings, count(mine), count(mine), count(theirs, completion_tokens=1))
    period = "from=2026-03-10&to=2026-03-10"

    assert client.get(f"/admin/usage?{period}").status_code == 401
    denied = client.get(f"/admin/usage?{period}", headers={"Authorization": f"Bearer {KEY}"})
    assert denied.status_code == 403
    error = denied.get_json()["error"]
    assert error["type"] == "permission_error", error

    admin = {"Authorization": f"Bearer {ADMIN}"}
    body = client.get(f"/admin/usage?{period}", headers=admin).get_json()
    assert {r["key"]: r["requests"] for r in body["data"]} == {mine[:16]: 2, theirs[:16]: 1}
    assert all(KEY not in str(r) and ADMIN not in str(r) for r in body["data"])
    for key in (mine, mine[:16]):
        one = client.get(f"/admin/usage?{period}&key={key}", headers=admin).get_json()
        assert one["totals"]["requests"] == 2 and one["totals"]["completion_tokens"] == 10


def sample(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    assert match, f"no {name}{{{labels}}} in the scrape"
    return float(match.group(1))


def test_metrics_export_the_all_time_counts(client: FlaskClient, settings: Settings) -> None:
    owner = "k" * 64
    end(settings, count(owner, cached_tokens=3), count(owner, error=True))
    text = client.get("/metrics").get_data(as_text=True)
    labels = f'api="{CHAT}",key="{"k" * 16}",model="m"'
    assert sample(text, "tokenrelay_usage_requests_total", labels) == 2
    assert sample(text, "tokenrelay_usage_prompt_tokens_total", labels) == 20
    assert sample(text, "tokenrelay_usage_cached_tokens_total", labels) == 3
    assert sample(text, "tokenrelay_usage_completion_tokens_total", labels) == 10
    assert sample(text, "tokenrelay_usage_errors_total", labels) == 1
    assert "k" * 17 not in text


def test_metrics_keep_the_busiest_label_sets(settings: Settings) -> None:
    end(settings, *[count(c * 64) for c in "abc"], count("b" * 64))
    client = redis.Redis.from_url(settings.redis_url)
    try:
        families = list(usage_families(client, Keys(settings.key_prefix), limit=2))
    finally:
        client.close()
    requests = next(f for f in families if f.name == "tokenrelay_usage_requests")
    assert [(s.labels["key"], s.value) for s in requests.samples] == [
        ("b" * 16, 2.0),
        ("a" * 16, 1.0),
    ]
    sets = next(f for f in families if f.name == "tokenrelay_usage_label_sets")
    assert sets.samples[0].value == 3
