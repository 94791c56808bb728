"""Keys managed at run time and rate limits across two web processes (issue 44): real
processes (redis-server, a worker with the echo engine, a streamer, two gunicorn web
servers on different ports), clients over HTTP.

- A key over its tokens per minute is refused (429, ``rate_limit_exceeded``, OpenAI's
  ``x-ratelimit-*`` headers) by whichever web process it asks: the count is in Redis,
  made in the admission script; every success carries the headers too.
- A key revoked through one process is 401 on both within a second, and its open stream
  on the other ends with an ``api_key_revoked`` error event and ``[DONE]``.
- A key rotated through one process: the old secret is 401 on both within a second, the
  new one works on both. No restart anywhere.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.stack import full_stack, isolated_settings, wait_for, web_process, web_settings
from tests.web.test_managed_keys import bearer, within_one_minute

pytestmark = pytest.mark.e2e

ADMIN = "e2e-admin-key-0123456789"
RATE = 20.0  # echo tokens per second: a long prompt streams for seconds


@pytest.fixture(scope="module")
def two_webs(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        api_keys=[ADMIN],
        admin_api_keys=[ADMIN],
        echo_tokens_per_second=RATE,
        web_workers=1,
        web_threads=16,
    )
    logs = tmp_path_factory.mktemp("managed-keys-logs")
    with full_stack(settings, logs) as stack:
        b = web_settings(stack.settings)
        with web_process(b, logs, name="web-b"):
            yield stack.base_url, f"http://{b.host}:{b.port}"


def new_key(base: str, **fields: Any) -> dict[str, Any]:
    resp = requests.post(
        f"{base}/admin/keys", json={"name": "e2e", **fields}, headers=bearer(ADMIN), timeout=10
    )
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


def chat(base: str, key: str, content: str = "hi", **extra: Any) -> requests.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 50, **extra}
    return requests.post(f"{base}/v1/chat/completions", json=body, headers=bearer(key), timeout=60)


def status_within(base: str, key: str, want: int, within_s: float) -> float:
    """Seconds until ``GET /v1/models`` with ``key`` answers ``want`` (fails after
    ``within_s``)."""
    started = time.monotonic()
    wait_for(
        lambda: (
            requests.get(f"{base}/v1/models", headers=bearer(key), timeout=5).status_code == want
        ),
        within_s,
        f"{want} from {base}",
        interval=0.02,
    )
    return time.monotonic() - started


def test_tokens_per_minute_hold_across_both_web_processes(two_webs: tuple[str, str]) -> None:
    a, b = two_webs
    key = new_key(a, tokens_per_minute=400)["secret"]
    within_one_minute(10.0)
    answers = []
    for i in range(20):  # each reserves its prompt + 50 tokens, keeps what it used
        resp = chat(a if i % 2 == 0 else b, key, f"question {i}")
        answers.append(resp)
        if resp.status_code == 429:
            break
    ok, refused = answers[:-1], answers[-1]
    assert ok and all(r.status_code == 200 for r in ok), [r.text for r in ok]
    for r in ok:
        assert r.headers["x-ratelimit-limit-tokens"] == "400"
        assert int(r.headers["x-ratelimit-remaining-tokens"]) < 400
        assert r.headers["x-ratelimit-reset-tokens"].endswith("s")
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["x-ratelimit-limit-tokens"] == "400"
    # Refused because what is left is less than it reserves: its prompt + 50.
    reserve = ok[-1].json()["usage"]["prompt_tokens"] + 50
    assert int(refused.headers["x-ratelimit-remaining-tokens"]) < reserve
    # Each finished request gave back what it did not use: what is counted is its usage.
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    check = requests.get(f"{b}/v1/models", headers=bearer(key), timeout=5)
    assert int(check.headers["x-ratelimit-remaining-tokens"]) == 400 - used


def test_a_revoked_key_is_refused_everywhere_within_a_second(two_webs: tuple[str, str]) -> None:
    a, b = two_webs
    key = new_key(a)
    secret = key["secret"]
    long_text = " ".join(f"word{i}" for i in range(200))  # ~10 s at 20 tokens/s
    events: list[Any] = []
    done = threading.Event()

    def follow() -> None:
        with requests.post(
            f"{a}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": long_text}], "stream": True},
            headers=bearer(secret),
            stream=True,
            timeout=60,
        ) as resp:
            events.append(resp.status_code)
            for raw in resp.iter_lines():
                line = raw.decode()
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
        done.set()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    wait_for(lambda: len(events) >= 6 or done.is_set(), 30, "the stream to flow")
    assert events[0] == 200 and not done.is_set(), events
    revoked_at = time.monotonic()
    gone = requests.delete(f"{b}/admin/keys/{key['id']}", headers=bearer(ADMIN), timeout=10)
    assert gone.status_code == 200
    took = [status_within(base, secret, 401, 1.0) for base in (a, b)]
    assert all(t <= 1.0 for t in took), took
    assert done.wait(10), "the revoked key's stream did not end"
    ended = time.monotonic() - revoked_at
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert events[-1] == "[DONE]" and errors, events[-3:]
    assert errors[0]["error"]["code"] == "api_key_revoked"
    assert ended < 8.0


def test_a_rotated_key_s_old_secret_fails_and_the_new_one_works(two_webs: tuple[str, str]) -> None:
    a, b = two_webs
    key = new_key(a)
    old = key["secret"]
    for base in (a, b):
        assert requests.get(f"{base}/v1/models", headers=bearer(old), timeout=5).status_code == 200
    rotated = requests.post(f"{a}/admin/keys/{key['id']}/rotate", headers=bearer(ADMIN), timeout=10)
    new = rotated.json()["secret"]
    for base in (a, b):
        assert status_within(base, old, 401, 1.0) <= 1.0
        assert status_within(base, new, 200, 1.0) <= 1.0
    assert chat(b, new, "after the rotation").status_code == 200
