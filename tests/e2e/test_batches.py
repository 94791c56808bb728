"""The Files + Batches API with the official ``openai`` SDK against a real stack.

redis-server, a Celery worker (echo engine at a slow rate, so batches take seconds), a
streamer, the batch driver and the web server (gunicorn) all run as real processes.
Each test checks what a client sees: statuses, request_counts, and the output and
error files line by line; and that batches survive the web server and the batch driver
being restarted or killed mid-batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from app.settings import Settings
from tests.stack import (
    Stack,
    batcher_process,
    full_stack,
    isolated_settings,
    wait_for,
    web_process,
)

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
TERMINAL = {"completed", "failed", "cancelled", "expired"}


@pytest.fixture(scope="module")
def batch_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from app.prepare import prepare_bundled_model

    root = tmp_path_factory.mktemp("models")
    prepare_bundled_model(root, progress=lambda _msg: None)
    return root


@pytest.fixture(scope="module")
def exits() -> Iterator[ExitStack]:
    """Stops the module's processes, including those tests start to replace others."""
    with ExitStack() as es:
        yield es


def batch_settings(models_dir: Path) -> Settings:
    """Echo at 25 steps/s (a 6-token line takes ~0.3 s) and at most 4 lines of a batch in
    flight, so a 40-line batch runs for several seconds."""
    return isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=25.0,
        batch_max_in_flight=4,
        batch_lock_ttl_s=2.0,
        batch_max_file_bytes=64 * 1024,
        web_workers=1,
        web_threads=16,
    )


@pytest.fixture(scope="module")
def stack(
    batch_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, exits: ExitStack
) -> Stack:
    """One stack for the module (``batch_settings``)."""
    log_dir = tmp_path_factory.mktemp("logs")
    st = exits.enter_context(full_stack(batch_settings(batch_models_dir), log_dir))
    st.procs["batcher"] = exits.enter_context(batcher_process(st.settings, log_dir))
    return st


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat_line(custom_id: str, text: str, model: str, **extra: Any) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def upload(client: openai.OpenAI, lines: list[str]) -> str:
    f = client.files.create(file=("input.jsonl", "\n".join(lines).encode()), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len("\n".join(lines).encode())
    return f.id


def poll(
    client: openai.OpenAI, batch_id: str, *, until: set[str] = TERMINAL, timeout: float = 90.0
) -> tuple[Any, list[Any]]:
    """Retrieve until the status is in ``until``; returns (batch, every batch seen)."""
    seen: list[Any] = []
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        seen.append(batch)
        if batch.status in until:
            return batch, seen
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.2)


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line]


def test_fifty_lines_one_invalid(client: openai.OpenAI, stack: Stack) -> None:
    model = stack.settings.served_name
    texts = {f"req-{i}": f"Line {i} says hello" for i in range(50)}
    lines = [chat_line(cid, text, model) for cid, text in texts.items()]
    lines[17] = chat_line("req-17", texts["req-17"], model, temperature=7)  # invalid
    file_id = upload(client, lines)

    batch = client.batches.create(
        input_file_id=file_id,
        endpoint=CHAT,
        completion_window="24h",
        metadata={"purpose": "e2e"},
    )
    assert batch.id.startswith("batch_") and batch.status == "validating"
    assert batch.metadata == {"purpose": "e2e"}
    assert batch.expires_at == batch.created_at + 24 * 3600

    batch, seen = poll(client, batch.id)
    assert batch.status == "completed", stack.logs()
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (50, 49, 1)
    # request_counts only ever move forward while the batch runs.
    done = [b.request_counts.completed for b in seen]
    assert done == sorted(done)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at

    output = jsonl(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(set(texts) - {"req-17"})
    for o in output:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        resp = o["response"]
        assert resp["status_code"] == 200
        body = resp["body"]
        assert body["object"] == "chat.completion" and body["model"] == model
        choice = body["choices"][0]
        # The echo engine answers with the last user message.
        assert choice["message"] == {
            "role": "assistant",
            "content": texts[o["custom_id"]],
            "refusal": None,
        }
        assert choice["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] > 0

    errors = jsonl(client, batch.error_file_id)
    assert len(errors) == 1
    err = errors[0]
    assert err["custom_id"] == "req-17"
    assert err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "temperature"
    assert err["error"]["message"]

    out_file = client.files.retrieve(batch.output_file_id)
    assert out_file.purpose == "batch_output"
    listed = client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]


def test_cancel_mid_batch_keeps_partial_results(client: openai.OpenAI, stack: Stack) -> None:
    model = stack.settings.served_name
    lines = [chat_line(f"c-{i}", f"Cancel test line number {i}", model) for i in range(40)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    wait_for(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 4,
        30,
        "some lines to complete",
        interval=0.1,
    )
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    batch, _ = poll(client, batch.id)
    assert batch.status == "cancelled", stack.logs()
    assert batch.cancelling_at and batch.cancelled_at
    counts = batch.request_counts
    assert 4 <= counts.completed < 40 and counts.failed == 0

    output = jsonl(client, batch.output_file_id)
    assert len(output) == counts.completed
    for o in output:
        n = o["custom_id"].split("-")[1]
        assert o["response"]["body"]["choices"][0]["message"]["content"] == (
            f"Cancel test line number {n}"
        )
    not_run = jsonl(client, batch.error_file_id)
    assert {e["error"]["code"] for e in not_run} == {"batch_cancelled"}
    assert all(e["response"] is None for e in not_run)
    ids = [o["custom_id"] for o in output] + [e["custom_id"] for e in not_run]
    assert sorted(ids) == sorted(f"c-{i}" for i in range(40))  # every line, exactly once

    # Cancelling again is harmless; a finished batch cannot be cancelled.
    assert client.batches.cancel(batch.id).status == "cancelled"


def test_a_cancel_while_validating_counts_every_line(client: openai.OpenAI, stack: Stack) -> None:
    """Cancelled before its driver took it: every line in the error file and in
    ``total`` (``total - completed - failed`` lines did not run), though the batch never
    went ``in_progress``, where ``total`` is set otherwise."""
    model = stack.settings.served_name
    lines = [chat_line(f"v-{i}", f"line {i}", model) for i in range(3)] + ["not json"]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch, _ = poll(client, batch.id)
    assert batch.status == "cancelled", stack.logs()
    assert batch.in_progress_at is None  # cancelled while validating
    counts = batch.request_counts
    errors = jsonl(client, batch.error_file_id)
    not_run = [e for e in errors if e["error"]["code"] == "batch_cancelled"]
    assert (counts.total, counts.completed, counts.failed) == (4, 0, 1)
    assert len(errors) == 4 and len(not_run) == counts.total - counts.completed - counts.failed


def test_batch_survives_a_web_restart(
    client: openai.OpenAI, stack: Stack, exits: ExitStack
) -> None:
    model = stack.settings.served_name
    lines = [chat_line(f"w-{i}", f"Web restart line {i}", model) for i in range(40)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", 30, "in_progress")
    stack.procs["web"].stop()
    stack.procs["web"] = exits.enter_context(
        web_process(stack.settings, stack.log_dir, name="web2")
    )
    batch, _ = poll(client, batch.id)
    assert batch.status == "completed", stack.logs()
    assert batch.request_counts.completed == 40
    output = jsonl(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"w-{i}" for i in range(40))


def test_a_killed_driver_is_replaced_without_losing_or_repeating_lines(
    client: openai.OpenAI, stack: Stack, exits: ExitStack
) -> None:
    model = stack.settings.served_name
    lines = [chat_line(f"k-{i}", f"Driver kill line {i}", model) for i in range(40)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    wait_for(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 6,
        30,
        "some lines to complete",
        interval=0.1,
    )
    stack.procs["batcher"].kill()  # SIGKILL: its lock is left to expire
    stack.procs["batcher"] = exits.enter_context(
        batcher_process(stack.settings, stack.log_dir, name="batcher2")
    )
    batch, _ = poll(client, batch.id)
    assert batch.status == "completed", stack.logs()
    # The new driver took the batch over mid-way, following the lines already sent.
    assert f"driving batch {batch.id} (status in_progress)" in stack.procs["batcher"].output()
    assert batch.request_counts.completed == 40
    output = jsonl(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"k-{i}" for i in range(40))
    # Each line ran as its one request (line i is request <batch>-i): none was resubmitted.
    assert sorted(o["response"]["request_id"] for o in output) == sorted(
        f"{batch.id}-{i}" for i in range(40)
    )


def test_file_errors(client: openai.OpenAI, stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-doesnotexist")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_doesnotexist")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-doesnotexist", endpoint=CHAT, completion_window="24h"
        )
    file_id = upload(client, [chat_line("a", "hi", stack.settings.served_name)])
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/embeddings",  # type: ignore[arg-type]
            completion_window="24h",
        )
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file_id,
            endpoint=CHAT,
            completion_window="48h",  # type: ignore[arg-type]
        )
    # Over batch_max_file_bytes (64 KiB here): a clear 413.
    big = requests.post(
        stack.base_url + "/v1/files",
        files={"file": ("big.jsonl", b"x" * (100 * 1024))},
        data={"purpose": "batch"},
        timeout=10,
    )
    assert big.status_code == 413
    assert "at most 65536 bytes" in big.json()["error"]["message"]
    deleted = client.files.delete(file_id)
    assert deleted.deleted and deleted.id == file_id
    with pytest.raises(openai.NotFoundError):
        client.files.content(file_id)


def test_a_batch_of_duplicate_custom_ids_fails(client: openai.OpenAI, stack: Stack) -> None:
    model = stack.settings.served_name
    file_id = upload(client, [chat_line("same", "one", model), chat_line("same", "two", model)])
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    batch, _ = poll(client, batch.id)
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None and batch.errors.data
    assert batch.errors.data[0].code == "duplicate_custom_id"
    assert batch.errors.data[0].line == 2


def test_stop_cases_same_text_in_batch_lines(client: openai.OpenAI, stack: Stack) -> None:
    """Every stop case of tests/e2e/stop_cases.py as one batch line: the same text,
    finish and stop reasons as the engine + decoders alone (and so as SSE, JSON and
    the WebSocket, whose tests compare against the same expectation)."""
    from app.model_card import load_model_card, load_tokenizer
    from tests.e2e.stop_cases import CASES, chat_body, expected

    model = stack.settings.served_name
    model_dir = stack.settings.model_path()
    tokenizer = load_tokenizer(load_model_card(model_dir))
    lines = [
        json.dumps(
            {
                "custom_id": case,
                "method": "POST",
                "url": CHAT,
                "body": chat_body(case, model, tokenizer),
            }
        )
        for case in sorted(CASES)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    batch, _ = poll(client, batch.id, timeout=120)
    assert batch.status == "completed", batch
    results = {line["custom_id"]: line for line in jsonl(client, batch.output_file_id)}
    assert jsonl(client, batch.error_file_id) == []
    for case in sorted(CASES):
        want = expected(case, model_dir, model)
        body = results[case]["response"]["body"]
        got = {
            c["index"]: (c["message"]["content"], c["finish_reason"], c["stop_reason"])
            for c in body["choices"]
        }
        assert got == {
            i: (want.texts[i], want.finish_reasons[i], want.stop_reasons[i]) for i in want.texts
        }, case
        assert body["usage"]["completion_tokens"] == want.completion_tokens, case
