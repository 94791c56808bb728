"""Requests start one at a time per process, in arrival order (``broker.runner``'s start
turn): a burst is served first come, first served instead of everyone waiting for
everyone. A start stuck longer than ``START_TURN_WAIT_S`` does not hold the rest."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import broker.runner
from app.intake import Endpoint
from broker.run import Run
from broker.runner import Runner
from tests.web.conftest import RequestIds, ScriptedOutput, final, usage

BODY = {"prompt": "x", "stream": True, "max_tokens": 1}


def test_starts_take_turns_in_arrival_order(
    service: Runner, ids: RequestIds, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepare = service.intake.prepare
    inside: list[int] = []
    overlaps: list[int] = []
    order: list[str] = []

    def slow_prepare(*args: Any, **kwargs: Any) -> Any:
        inside.append(1)
        if len(inside) > 1:
            overlaps.append(len(inside))
        order.append(threading.current_thread().name)
        time.sleep(0.05)
        inside.pop()
        return prepare(*args, **kwargs)

    monkeypatch.setattr(service.intake, "prepare", slow_prepare)
    runs: list[Run] = []
    threads = [
        threading.Thread(
            target=lambda: runs.append(service.start(Endpoint.COMPLETIONS, BODY)), name=f"t{i}"
        )
        for i in range(6)
    ]
    for t in threads:
        t.start()
        time.sleep(0.01)  # arrival order t0, t1, ...
    for t in threads:
        t.join(10)
    for run in runs:
        run.close()
    assert len(runs) == 6
    assert overlaps == [], "two starts ran at once"
    assert order == [f"t{i}" for i in range(6)]


def test_a_stuck_start_does_not_hold_the_others(
    service: Runner,
    ids: RequestIds,
    scripted: ScriptedOutput,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(broker.runner, "START_TURN_WAIT_S", 0.3)
    prepare = service.intake.prepare
    release = threading.Event()

    def stuck_first(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "stuck":
            release.wait(10)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(service.intake, "prepare", stuck_first)
    stuck = threading.Thread(
        target=lambda: service.start(Endpoint.COMPLETIONS, BODY).close(), name="stuck"
    )
    stuck.start()
    time.sleep(0.05)
    started = time.monotonic()
    rid = ids.peek()
    run = service.start(Endpoint.COMPLETIONS, BODY)
    waited = time.monotonic() - started
    assert run.request_id == rid
    assert 0.2 <= waited < 2.0, f"waited {waited:.2f}s for a stuck start"
    scripted.write(rid, final(0), usage())
    run.close()
    release.set()
    stuck.join(10)
