"""Files and batches on a real redis-server: storage, listing, the status machine, the
driver's lock fence, write-once line results; and the batch driver's expiry, run
in-process with a clock the test controls against a real worker and streamer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from app.batches import BatchStatus, not_run_line, success_line
from app.records import RequestRecord, StopConditions
from app.settings import Settings
from broker.batches import BatchBody, BatchStore, Transition
from broker.files import FileStore
from broker.keys import Keys
from broker.requests import RequestStore
from broker.runner import Runner
from tests.stack import streamer_process, wait_for, worker_process
from workers.batcher import BatchDriver

pytestmark = pytest.mark.integration

DAY = 24 * 3600


@pytest.fixture
def keys(settings: Settings) -> Keys:
    return Keys(settings.key_prefix)


@pytest.fixture
def files(redis_client: redis.Redis, keys: Keys) -> FileStore:
    return FileStore(redis_client, keys, ttl_s=600)


@pytest.fixture
def batches(redis_client: redis.Redis, keys: Keys) -> BatchStore:
    return BatchStore(redis_client, keys, ttl_s=600)


def body(bid: str, now: float = 1000.0, **extra: object) -> BatchBody:
    values: dict[str, object] = {
        "id": bid,
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-x",
        "completion_window": "24h",
        "created_at": int(now),
        "expires_at": int(now) + DAY,
    }
    values.update(extra)
    return BatchBody.model_validate(values)


# -- files ----------------------------------------------------------------------------


def test_file_round_trip_with_ttl(files: FileStore, redis_client: redis.Redis, keys: Keys) -> None:
    obj = files.create(filename="in.jsonl", purpose="batch", content=b"a\nb\n", now=1000.5)
    assert obj.id.startswith("file-") and obj.bytes == 4 and obj.created_at == 1000
    assert obj.expires_at == 1000 + 600
    assert files.get(obj.id) == obj
    assert files.content(obj.id) == b"a\nb\n"
    assert 0 < redis_client.ttl(keys.file(obj.id)) <= 600
    assert files.delete(obj.id)
    assert files.get(obj.id) is None and files.content(obj.id) is None
    assert not files.delete(obj.id)


def test_file_pages_newest_first_and_forget_expired_files(
    files: FileStore, redis_client: redis.Redis, keys: Keys
) -> None:
    ids = [
        files.create(filename=f"{i}", purpose="batch", content=b"x", now=1000 + i).id
        for i in range(5)
    ]
    out = files.create(filename="o", purpose="batch_output", content=b"y", now=2000).id
    page = files.page(limit=2, purpose="batch")
    assert [f.id for f in page.data] == [ids[4], ids[3]] and page.has_more
    assert (page.first_id, page.last_id) == (ids[4], ids[3])
    redis_client.delete(keys.file(ids[2]))  # as if its TTL ran out
    page = files.page(after=page.last_id, limit=5)
    assert [f.id for f in page.data] == [ids[1], ids[0]] and not page.has_more
    assert redis_client.zscore(keys.files, ids[2]) is None  # pruned on the way
    assert files.page(limit=1).data[0].id == out
    assert files.page(after="file-unknown").data == []


# -- batches --------------------------------------------------------------------------


def test_batch_create_get_and_list(batches: BatchStore, redis_client: redis.Redis) -> None:
    created = [batches.create(body(f"batch_{i}", 1000 + i), 1000 + i) for i in range(3)]
    b = created[0]
    assert b.status is BatchStatus.VALIDATING and b.object == "batch"
    assert b.request_counts.total == 0 and b.output_file_id is None and b.errors is None
    assert batches.get("batch_0") == b
    assert batches.get("batch_missing") is None
    assert batches.active() == ["batch_0", "batch_1", "batch_2"]  # oldest first
    page = batches.page(limit=2)
    assert [x.id for x in page.data] == ["batch_2", "batch_1"] and page.has_more
    page = batches.page(after="batch_1", limit=2)
    assert [x.id for x in page.data] == ["batch_0"] and not page.has_more
    dumped = b.to_dict()
    for name in ("in_progress_at", "cancelled_at", "expired_at", "error_file_id", "metadata"):
        assert name in dumped and dumped[name] is None  # OpenAI sends every field


def test_status_machine_and_cancel(batches: BatchStore) -> None:
    batches.create(body("batch_s"), 1000)
    assert batches.request_cancel("batch_missing", 1001) is Transition.MISSING
    assert batches.acquire("batch_s", "d1", 10)
    moved = batches.transition(
        "batch_s",
        BatchStatus.IN_PROGRESS,
        1001,
        allowed_from=(BatchStatus.VALIDATING,),
        driver="d1",
        fields={"total": 3},
    )
    assert moved is Transition.DONE
    # Another driver's write is fenced off; a wrong status is refused.
    assert (
        batches.transition(
            "batch_s",
            BatchStatus.FINALIZING,
            1002,
            allowed_from=(BatchStatus.IN_PROGRESS,),
            driver="d2",
        )
        is Transition.NOT_LOCKED
    )
    assert (
        batches.transition(
            "batch_s",
            BatchStatus.COMPLETED,
            1002,
            allowed_from=(BatchStatus.FINALIZING,),
            driver="d1",
        )
        is Transition.WRONG_STATUS
    )
    assert batches.request_cancel("batch_s", 1003) is Transition.DONE
    assert batches.request_cancel("batch_s", 1004) is Transition.WRONG_STATUS
    b = batches.get("batch_s")
    assert b is not None and b.status is BatchStatus.CANCELLING
    assert (b.in_progress_at, b.cancelling_at, b.request_counts.total) == (1001, 1003, 3)
    assert (
        batches.transition(
            "batch_s",
            BatchStatus.CANCELLED,
            1005,
            allowed_from=(BatchStatus.CANCELLING,),
            driver="d1",
            fields={"error_file_id": "file-e"},
        )
        is Transition.DONE
    )
    b = batches.get("batch_s")
    assert b is not None and b.status is BatchStatus.CANCELLED and b.error_file_id == "file-e"
    assert "batch_s" not in batches.active()  # terminal: off the work list, lock dropped
    assert batches.acquire("batch_s", "d2", 10)


def test_locks_expire_and_are_fenced(batches: BatchStore) -> None:
    batches.create(body("batch_l"), 1000)
    assert batches.acquire("batch_l", "d1", 0.2)
    assert not batches.acquire("batch_l", "d2", 10)
    assert batches.refresh("batch_l", "d1", 0.2)
    assert not batches.refresh("batch_l", "d2", 10)
    time.sleep(0.3)  # d1 went silent: its lock runs out and d2 takes over
    assert batches.acquire("batch_l", "d2", 10)
    assert not batches.refresh("batch_l", "d1", 10)
    batches.release("batch_l", "d1")  # not d1's any more: no effect
    assert not batches.acquire("batch_l", "d3", 10)
    batches.release("batch_l", "d2")
    assert batches.acquire("batch_l", "d3", 10)


def test_results_are_written_once_with_their_counters(batches: BatchStore) -> None:
    batches.create(body("batch_r"), 1000)
    assert batches.acquire("batch_r", "d1", 10)
    ok = success_line("a", "rid-0", {"object": "chat.completion"})
    assert batches.record("batch_r", "d1", 0, ok, "completed") == 1
    assert batches.record("batch_r", "d1", 0, ok, "completed") == 0  # a takeover folds again
    assert batches.record("batch_r", "d2", 1, ok, "completed") == -1  # not the lock holder
    skipped = not_run_line("b", "batch_cancelled", "not run")
    assert batches.record("batch_r", "d1", 2, skipped, "") == 1
    b = batches.get("batch_r")
    assert b is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (1, 0)
    assert batches.recorded("batch_r") == {0, 2}
    assert [(i, line.custom_id) for i, line in batches.results("batch_r")] == [(0, "a"), (2, "b")]


def test_submit_line_is_fenced_and_never_writes_a_record_twice(
    batches: BatchStore, store: RequestStore, redis_client: redis.Redis, keys: Keys
) -> None:
    batches.create(body("batch_q"), 1000)
    record = RequestRecord(
        request_id="batch_q-3",
        model="m",
        prompts=[[1, 2]],
        stop=StopConditions(max_tokens=4),
        created=1000,
        deadline=2000,
        queue="batch",
    )
    assert not batches.submit_line("batch_q", "d1", 3, record, store)  # no lock held
    assert batches.acquire("batch_q", "d1", 10)
    assert batches.submit_line("batch_q", "d1", 3, record, store)
    assert batches.progress("batch_q") == (BatchStatus.VALIDATING, 4)
    loaded = store.load("batch_q-3")
    assert loaded is not None and loaded[0] == record
    assert not batches.submit_line("batch_q", "d1", 3, record, store)  # already written
    assert redis_client.xlen(keys.new_requests) == 1


# -- the driver: expiry ------------------------------------------------------------------


def test_an_expired_batch_ends_with_what_finished(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The completion window passes mid-batch (the driver's clock jumps a day ahead):
    running lines are cancelled, finished ones are kept, the rest are listed as
    ``batch_expired``, and the batch ends ``expired``."""
    settings = settings.model_copy(
        update={"echo_tokens_per_second": 20.0, "batch_max_in_flight": 2}
    )
    now = [time.time()]
    keys = Keys(settings.key_prefix)
    files = FileStore(redis_client, keys, ttl_s=600)
    batches = BatchStore(redis_client, keys, ttl_s=600)
    lines = [
        json.dumps(
            {
                "custom_id": f"x-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": f"expiry line {i}"}]},
            }
        )
        for i in range(12)
    ]
    f = files.create(filename="in", purpose="batch", content="\n".join(lines).encode(), now=now[0])
    batches.create(body("batch_exp", now[0], input_file_id=f.id), now[0])
    driver = BatchDriver(settings, Runner(settings, max_connections=8), clock=lambda: now[0])
    with worker_process(settings, tmp_path), streamer_process(settings, tmp_path):

        def some_done() -> bool:
            driver.iterate()
            b = batches.get("batch_exp")
            return b is not None and b.request_counts.completed >= 2

        wait_for(some_done, 60, "some lines to finish", interval=0)
        now[0] += DAY + 1

        def ended() -> bool:
            driver.iterate()
            b = batches.get("batch_exp")
            return b is not None and b.status.terminal

        wait_for(ended, 60, "the batch to expire", interval=0)
    b = batches.get("batch_exp")
    assert b is not None and b.status is BatchStatus.EXPIRED
    assert b.expired_at == int(now[0]) and b.finalizing_at
    assert 2 <= b.request_counts.completed < 12 and b.request_counts.failed == 0
    out = files.content(b.output_file_id or "") or b""
    err = files.content(b.error_file_id or "") or b""
    done = [json.loads(x) for x in out.decode().splitlines()]
    expired = [json.loads(x) for x in err.decode().splitlines()]
    assert len(done) == b.request_counts.completed
    assert {e["error"]["code"] for e in expired} == {"batch_expired"}
    assert sorted(x["custom_id"] for x in done + expired) == sorted(f"x-{i}" for i in range(12))
