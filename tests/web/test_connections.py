"""Open streams of a web process are read by one hub thread (broker.hub.OutputHub):
many concurrent streams need neither a Redis connection nor a round trip each. (With a
connection per stream, the 101st concurrent stream failed on redis-py's default pool:
found by benchmarks/sse_clients.py with 200 clients.)"""

from __future__ import annotations

import threading

from app.intake import Endpoint
from app.messages import FinishReason, OutputEvent, OutputKind
from broker.outputs import OutputEntry
from broker.run import Run
from broker.runner import Runner


def follow(runner: Runner, rid: str) -> Run:
    """A run over request ``rid`` (never submitted: the test writes its output)."""
    prepared = runner.intake.prepare(Endpoint.COMPLETIONS, {"prompt": "x"}, request_id=rid)
    return runner.follow(prepared)


def test_many_open_streams_share_one_reader(service: Runner) -> None:
    streams = 150
    firsts: list[object] = []
    lock = threading.Lock()
    started = threading.Barrier(streams + 1)
    release = threading.Event()

    def reader(i: int) -> None:
        run = follow(service, f"nobody-{i}")
        first = run.next(0.3)  # nothing written: a keep-alive tick
        started.wait()
        release.wait(10)
        run.detach()
        with lock:
            firsts.append(first)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    started.wait(30)
    assert service.hub.followed == streams
    release.set()
    for t in threads:
        t.join(30)
    assert firsts == [None] * streams
    assert service.hub.followed == 0


def test_each_subscriber_gets_its_own_entries_in_order(service: Runner) -> None:
    rids = [f"req-{i}" for i in range(3)]
    readers = {rid: follow(service, rid) for rid in rids}
    for n in range(5):
        service.outputs.write(
            [
                OutputEntry(rid, [OutputEvent(OutputKind.DELTA, 0, f"{rid}:{n} ")], f"1-{n}")
                for rid in rids
            ]
        )
    service.outputs.write(
        [
            OutputEntry(
                rid,
                [
                    OutputEvent(OutputKind.FINAL, 0, finish_reason=FinishReason.STOP),
                    OutputEvent(OutputKind.USAGE, usage={}),
                ],
                "1-9",
            )
            for rid in rids
        ]
    )
    for rid, run in readers.items():
        got = []
        while not run.ended:
            item = run.next(2.0)
            assert item is not None
            got.append(item[1])
        run.close()
        assert "".join(e.text for e in got) == "".join(f"{rid}:{n} " for n in range(5))
        assert got[-1].kind is OutputKind.USAGE
    assert service.hub.followed == 0
