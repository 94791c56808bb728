"""Two models behind one web tier when one model's only worker dies (issue 41).

Real processes: redis-server, a worker per model (echo engine at a finite rate, so
streams are mid-way at the kill), a streamer, gunicorn. Model B's only worker is
SIGKILLed while both models stream: A's streams go on untouched and exact; B's resume,
exactly, on the B worker started again; once B has no worker at all, a new B request is
answered 503 within a second while A still serves. And a model no worker has served yet
(``known_models``) with ``model_wait_s``: its request waits, queued, for its first
worker, started 5 s later, and gets the exact text."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from broker.keys import Keys
from broker.registry import worker_registry
from tests.faults.conftest import REGISTRATION_TTL_S
from tests.faults.web_clients import CHAT, Stream, Unary, probe, start_stream, start_unary, words
from tests.stack import full_stack, isolated_settings, start_model_worker, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.slow]

RATE = 20.0  # echo tokens per second: ~85 tokens of ``words`` take ~4 s


@pytest.mark.timeout(150)
def test_model_b_losing_its_only_worker_leaves_model_a_exact(
    models_dir: Path, tmp_path: Path
) -> None:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=RATE,
        lease_ttl_s=1.5,
        web_workers=1,
        web_threads=32,
    )
    with full_stack(settings, tmp_path, workers=()) as stack:
        for model in ("model-a", "model-b"):
            start_model_worker(stack, model, model)
        streams = {
            (model, i): Stream(CHAT, words(f"{model} stream {i}"))
            for model in ("model-a", "model-b")
            for i in range(4)
        }
        threads = [start_stream(stack.base_url, m, s) for (m, _i), s in streams.items()]
        wait_for(lambda: all(s.text for s in streams.values()), 30, "every stream's first text")
        stack.procs["model-b"].kill()  # SIGKILL, mid-stream
        start_model_worker(stack, "model-b", "model-b-again")
        for t in threads:
            t.join(60)
        for (model, i), s in streams.items():
            assert s.done and s.failure is None and s.error is None, (model, i, s, stack.logs())
            assert s.text == s.content, (model, i)  # exact: nothing lost or repeated

        # B's last worker goes: once its registration is gone, B is 503 at once, A serves.
        stack.procs["model-b-again"].kill()
        live = worker_registry(stack.redis(), Keys(stack.settings.key_prefix))
        wait_for(
            lambda: all(w.model != "model-b" for w in live.live()),
            REGISTRATION_TTL_S + 5,
            "the killed worker's registration to expire",
        )
        body = {"model": "model-b", "messages": [{"role": "user", "content": "hi"}]}
        answer = probe("POST", stack.base_url + CHAT, "a B request", json=body)
        assert answer.status == 503 and answer.took_s < 1.0, answer
        a = Unary(CHAT, words("model-a after"))
        start_unary(stack.base_url, "model-a", a).join(30)
        assert a.status == 200 and a.text == a.content


@pytest.mark.timeout(120)
def test_a_model_s_first_worker_started_late_serves_a_waiting_request(
    models_dir: Path, tmp_path: Path
) -> None:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        known_models=["model-late"],
        model_wait_s=30.0,
        web_workers=1,
    )
    with full_stack(settings, tmp_path, workers=()) as stack:
        start_model_worker(stack, "model-a", "model-a")  # the stack is ready; late is not
        late = Unary(CHAT, words("waiting for its first worker"))
        asked = time.monotonic()
        thread = start_unary(stack.base_url, "model-late", late)
        time.sleep(5.0)
        assert thread.is_alive(), late  # waiting, queued: not refused
        start_model_worker(stack, "model-late", "model-late")
        thread.join(60)
        assert late.status == 200 and late.text == late.content, (late, stack.logs())
        assert time.monotonic() - asked >= 5.0
        # Unknown stays unknown: no waiting for a name never served or configured.
        unknown = probe(
            "POST",
            stack.base_url + CHAT,
            "an unknown model",
            json={"model": "model-x", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert unknown.status == 404
