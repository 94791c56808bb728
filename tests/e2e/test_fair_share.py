"""Fair share between API keys through real processes (issue 44): redis-server, one echo
worker with two slots, a streamer, gunicorn; two API keys.

Key A queues 40 streamed chats; then key B sends 4. With fair share the worker takes
B's requests next (``broker.fair_queue``), so each of B's starts before most of A's
waiting ones; with ``fair_share`` off they wait behind all of A's. The streamers resend
queued requests every second here (``requeue_after_s``): a resend puts a request back
in its key's queue, it never lets it past the others, and nothing runs twice. Every
text is exact.
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

from tests.stack import Stack, full_stack, isolated_settings, wait_for

pytestmark = pytest.mark.e2e

KEY_A = "fair-key-a-0123456789"
KEY_B = "fair-key-b-0123456789"
FLOOD = 40


@pytest.fixture(params=[True, False], ids=["fair", "arrival"])
def stack(request: pytest.FixtureRequest, models_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        api_keys=[KEY_A, KEY_B],
        fair_share=request.param,
        echo_tokens_per_second=100.0,
        worker_slots=2,
        requeue_after_s=1.0,
        web_workers=1,
        web_threads=64,
    )
    with full_stack(settings, tmp_path / "logs") as running:
        yield running


def chat(base: str, key: str, text: str, out: dict[str, Any]) -> None:
    got = []
    with requests.post(
        f"{base}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": text}], "stream": True},
        headers={"Authorization": f"Bearer {key}"},
        stream=True,
        timeout=120,
    ) as resp:
        for raw in resp.iter_lines():
            line = raw.decode()
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    if c["delta"].get("content"):
                        out.setdefault("first", time.monotonic())
                        got.append(c["delta"]["content"])
    out["text"] = "".join(got)


def test_a_flooding_key_does_not_hold_back_another(stack: Stack) -> None:
    words = " ".join(f"w{i}" for i in range(20))
    a = [{"sent": f"a{i} {words}"} for i in range(FLOOD)]
    b = [{"sent": f"b{i} {words}"} for i in range(4)]
    threads = []
    for key, outs in ((KEY_A, a), (KEY_B, b)):
        if key == KEY_B:  # once A's are all admitted, and many still queued
            wait_for(lambda: stack.admitted() + sum("text" in o for o in a) >= FLOOD, 30, "A")
            assert stack.queued() >= FLOOD // 2
        for out in outs:
            t = threading.Thread(target=chat, args=(stack.base_url, key, out["sent"], out))
            t.start()
            threads.append(t)
    for t in threads:
        t.join(120)
    for out in a + b:
        assert out.get("text") == out["sent"], out
    last_b = max(out["first"] for out in b)
    a_after = sum(1 for out in a if out["first"] > last_b)
    if stack.settings.fair_share:
        assert a_after >= FLOOD // 3, f"only {a_after} of A's started after B's last"
    else:
        assert a_after <= 4, f"{a_after} of A's started after B's last in arrival order"
