"""A conversation's worker dies between turns: the next turn runs cold elsewhere.

The bundled model on the llama.cpp engine, through the whole stack. Turn 1 leaves its
KV in worker A's prefix cache; A is SIGKILLed and worker B starts. Turn 2 must run on B
from nothing (``cached_tokens`` 0) and give exactly what a cold run of the same prompt
gives (a salted request: no prefix shared with anything); turn 3 reuses turn 2's KV on B.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from tests.stack import full_stack, isolated_settings, worker_process

pytest.importorskip("llama_cpp")

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def chat(base: str, model: str, messages: list[dict[str, str]], **extra: object) -> Any:
    body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0, **extra}
    with requests.post(f"{base}/v1/chat/completions", json=body, timeout=180) as resp:
        assert resp.status_code == 200, resp.text
        return resp.json()


def cached(answer: Any) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.timeout(300)
def test_the_next_turn_runs_cold_on_another_worker(models_dir: Path, tmp_path: Path) -> None:
    settings = isolated_settings("redis://unused", models_dir, worker_slots=2, lease_ttl_s=2.0)
    with full_stack(settings, tmp_path / "logs", engine="llamacpp") as stack:
        base, model = stack.base_url, stack.settings.served_name
        messages = [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is rain?"},
        ]
        first = chat(base, model, messages)
        messages += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Where does it come from?"},
        ]
        stack.procs["worker"].kill()
        with worker_process(stack.settings, stack.log_dir, name="worker-b"):
            second = chat(base, model, messages)
            assert cached(second) == 0
            cold = chat(base, model, messages, cache_salt="reference")
            assert cached(cold) == 0
            assert second["choices"][0]["message"] == cold["choices"][0]["message"]
            messages += [
                {"role": "assistant", "content": second["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Thanks."},
            ]
            third = chat(base, model, messages)
            assert cached(third) >= second["usage"]["prompt_tokens"] - 1
