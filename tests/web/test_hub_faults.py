"""The web tier's one reader (``broker.hub.OutputHub``) against bad keys, on a real
redis-server: what Redis refuses for one stream ends that stream's run only, and a run
that ends itself cancels its generation. (The same faults with real processes are in
``tests/faults/test_web_outage.py``.)"""

from __future__ import annotations

from app.intake import Endpoint
from app.messages import OutputKind
from broker.outputs import MALFORMED_OUTPUT
from broker.run import Item, Run
from broker.runner import Runner
from tests.web.conftest import ScriptedOutput, delta, final, usage


def follow(runner: Runner, rid: str) -> Run:
    """A run over request ``rid`` (never submitted: the test writes its output)."""
    prepared = runner.intake.prepare(Endpoint.COMPLETIONS, {"prompt": "x"}, request_id=rid)
    return runner.follow(prepared)


def read_all(run: Run, timeout_s: float = 5.0) -> list[Item]:
    got: list[Item] = []
    while not run.ended:
        item = run.next(timeout_s)
        assert item is not None, f"run {run.request_id} got nothing for {timeout_s}s"
        got.append(item)
    return got


def test_a_key_that_is_not_a_stream_ends_only_its_run(
    service: Runner, scripted: ScriptedOutput
) -> None:
    bad, good = follow(service, "bad-key"), follow(service, "good-key")
    scripted.write("good-key", delta(0, "one "))
    assert good.next(5.0) is not None  # the hub reads
    scripted.redis.set(scripted.keys.output("bad-key"), "not a stream")
    scripted.write("good-key", delta(0, "two"), final(0), usage())

    (cursor, event), *_ = read_all(bad)
    assert event is MALFORMED_OUTPUT and cursor == ""  # no stream position to resume from
    assert bad.ended_here and bad.failure is not None and bad.failure.status == 500
    texts = [ev.text for _c, ev in read_all(good) if ev.kind is OutputKind.DELTA]
    assert texts == ["two"] and not good.ended_here
    bad.close()
    good.close()
    assert scripted.cancelled("bad-key")  # it ended here: stop generating it
    assert not scripted.cancelled("good-key")  # its streamer ended it


def test_a_malformed_entry_ends_its_run_and_cancels_generation(
    service: Runner, scripted: ScriptedOutput
) -> None:
    run = follow(service, "garbage")
    scripted.write("garbage", delta(0, "fine "))
    scripted.redis.xadd(scripted.keys.output("garbage"), {"e": b"{nope", "s": "0-0"})
    got = read_all(run)
    assert [ev.kind for _c, ev in got] == [OutputKind.DELTA, OutputKind.ERROR]
    assert run.ended_here and got[-1][0].endswith("/0")  # the entry's own cursor
    run.close()
    assert scripted.cancelled("garbage")


def test_the_hub_recreates_its_own_wake_up_key(service: Runner, scripted: ScriptedOutput) -> None:
    first = follow(service, "before")
    scripted.write("before", delta(0, "a"))
    assert first.next(5.0) is not None
    scripted.redis.delete(service.hub.wake_key)
    scripted.redis.set(service.hub.wake_key, "overwritten")
    second = follow(service, "after")  # its wake-up XADD fails: WRONGTYPE
    scripted.write("after", delta(0, "b"), final(0), usage())
    scripted.write("before", final(0), usage())
    assert [ev.kind for _c, ev in read_all(second)][-1] is OutputKind.USAGE
    assert [ev.kind for _c, ev in read_all(first)][-1] is OutputKind.USAGE
    assert scripted.redis.type(service.hub.wake_key) in (b"stream", b"none")
    first.close()
    second.close()
