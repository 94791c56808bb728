"""The last worker dies: no request waits for nothing.

One worker (echo engine at a finite rate) and one streamer. One request is running when
the worker is SIGKILLed; another is admitted just after (the worker still looks alive:
its registration lives until its heartbeat TTL). Both must end with the streamer
watchdog's 503 "No worker is serving model" once the worker's registration has expired
and ``no_worker_timeout_s`` has passed: never a silent stall until the deadline."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from broker.keys import Keys
from broker.registry import worker_registry
from tests.faults.conftest import (
    LEASE_TTL_S,
    NO_WORKER_TIMEOUT_S,
    REGISTRATION_TTL_S,
    last_worker_settings,
)
from tests.pipeline import TEXT, Client, OutageReader
from tests.stack import full_stack, make_record

pytestmark = pytest.mark.faults


@pytest.mark.timeout(90)
def test_requests_end_with_503_after_the_last_worker_dies(
    models_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    with full_stack(last_worker_settings(models_dir), tmp_path, web=None) as stack:
        settings, worker = stack.settings, stack.procs["worker"]
        ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
        client = Client(settings)
        reader = OutageReader(settings)
        running = make_record(settings, [ids], max_tokens=200)
        client.submit(running)
        f_running = reader.follow(running)
        reader.poll(time.monotonic() + 20, stop=lambda: any(e.text for e in f_running.events))
        assert any(e.text for e in f_running.events)
        worker.kill()
        killed = time.monotonic()
        registry = worker_registry(client.redis, Keys(settings.key_prefix))
        assert registry.live(), "the dead worker should still look alive for a while"
        admitted = make_record(settings, [ids], max_tokens=200)
        client.submit(admitted)
        f_admitted = reader.follow(admitted)
        bound = REGISTRATION_TTL_S + NO_WORKER_TIMEOUT_S + LEASE_TTL_S + 4.0
        reader.poll(killed + bound + 5)
    for f in (f_running, f_admitted):
        assert f.ended_at is not None, "a request hangs after its last worker died"
        assert f.ended_at - killed < bound, f.ended_at - killed
        (err,) = f.result.errors
        assert err.code == 503 and "No worker" in (err.error or "")
        assert TEXT.startswith(f.result.texts.get(0, ""))
