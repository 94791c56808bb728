"""A second reader of a stream this process already follows gets every event from its
own cursor (``broker.hub.OutputHub``, real redis-server).

Two runs of one request in one web process are normal: a background response's
follower and a client streaming it, or a client that resumes on the process still
holding its old connection. The hub reads each stream once, from the lowest cursor of
the subscriptions it knew when its read began; a subscription that arrived during that
read, with a cursor below it, must wait for the next read instead of being handed the
entries after it (and moved past the ones it never got)."""

from __future__ import annotations

from typing import Any

import pytest

from app.intake import Endpoint
from app.messages import OutputKind
from broker.run import Run
from broker.runner import Runner
from tests.stack import wait_for
from tests.web.conftest import ScriptedOutput, delta, final, usage


def follow(runner: Runner, rid: str) -> Run:
    prepared = runner.intake.prepare(Endpoint.COMPLETIONS, {"prompt": "x"}, request_id=rid)
    return runner.follow(prepared)


def texts(run: Run) -> list[str]:
    got: list[str] = []
    while not run.ended:
        item = run.next(5.0)
        assert item is not None, "the run got nothing for 5 s"
        if item[1].kind is OutputKind.DELTA:
            got.append(item[1].text)
    return got


def test_a_reader_that_subscribes_during_a_read_misses_nothing(
    service: Runner, scripted: ScriptedOutput, monkeypatch: pytest.MonkeyPatch
) -> None:
    rid = "two-readers"
    first = follow(service, rid)
    scripted.write(rid, delta(0, "one "))
    scripted.write(rid, delta(0, "two "))
    assert [first.next(5.0) is not None for _ in range(2)] == [True, True]

    # The second reader subscribes (from the start) while the hub's read is in flight:
    # the read began at the first reader's cursor, after "one " and "two ".
    hub = service.hub
    real_reply = hub._direct.reply  # the hub thread's own connection: every read's reply
    joined: list[Run] = []
    calls: list[int] = []

    def reply(command: str) -> Any:
        res = real_reply(command)
        if command == "XREAD":
            calls.append(1)
            if res and not joined and any(rid in str(k) for k, _ in res):
                joined.append(follow(service, rid))
        return res

    monkeypatch.setattr(hub._direct, "reply", reply)
    other = follow(service, "wakes-the-hub")  # its wake-up ends the read in flight
    wait_for(lambda: calls, 5.0, "the hub's next read")
    scripted.write(rid, delta(0, "three"), final(0), usage())
    assert texts(first) == ["three"]
    (second,) = joined
    assert texts(second) == ["one ", "two ", "three"]
    for run in (first, second, other):
        run.close()
