"""The whole pipeline without the web tier: request record -> real Celery worker (echo
engine) -> real streamer process -> output stream; plus the kill tests."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from app.messages import EngineFinish, FinishReason, OutputEvent
from app.model_card import load_model_card, load_tokenizer
from app.settings import Settings
from broker.handoff import GROUP
from broker.server import RedisServer
from tests.pipeline import EOS, TEXT, Client, collect, reference
from tests.stack import isolated_settings, make_record, streamer_process, wait_for, worker_process

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tokenizer(models_dir: Path) -> Tokenizer:
    return load_tokenizer(load_model_card(models_dir / "SmolLM2-135M-Instruct"))


STOP_CASES: dict[str, dict[str, Any]] = {
    "stop_string": {"stop": ("lazy",)},
    "stop_string_visible": {"stop": ("lazy",), "include_stop_str_in_output": True},
    "stop_in_multibyte": {"stop": ("東",)},
    "two_stops_earliest_wins": {"stop": ("dog;", "over the")},
    "stop_token_id": {"stop_token_ids": ()},  # filled with a real id below
    "min_tokens_skips_early_stop": {"stop": ("quick",), "min_tokens": 6},
    "max_tokens": {"max_tokens": 7},
    "n3": {"n": 3, "stop": ("jumps",)},
}


@pytest.fixture(scope="module")
def stack(
    redis_server: RedisServer, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Settings]:
    settings = isolated_settings(redis_server.url, models_dir)
    logs = tmp_path_factory.mktemp("logs")
    with worker_process(settings, logs), streamer_process(settings, logs):
        yield settings


@pytest.mark.parametrize("case", sorted(STOP_CASES))
def test_pipeline_text_equals_decoder_alone(
    stack: Settings, tokenizer: Tokenizer, case: str
) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    kw = dict(STOP_CASES[case])
    if case == "stop_token_id":
        kw["stop_token_ids"] = (ids[5],)
    n = kw.pop("n", 1)
    max_tokens = kw.pop("max_tokens", 64)
    record = make_record(stack, [ids], n=n, max_tokens=max_tokens, **kw)
    got = Client(stack).run(record)
    want = reference(tokenizer, record)
    assert got.texts == want.texts
    assert {c: (f.finish_reason, f.stop_reason) for c, f in got.finals.items()} == {
        c: (f.finish_reason, f.stop_reason) for c, f in want.finals.items()
    }
    assert got.usage is not None and want.usage is not None
    assert got.usage["completion_tokens"] == want.usage["completion_tokens"]
    assert not got.errors


def test_list_of_prompts_choice_indices(stack: Settings, tokenizer: Tokenizer) -> None:
    a = tokenizer.encode("first prompt here", add_special_tokens=False).ids
    b = tokenizer.encode("second one", add_special_tokens=False).ids
    record = make_record(stack, [a, b], n=2)
    got = Client(stack).run(record)
    assert got.texts == {
        0: "first prompt here",
        1: "first prompt here",
        2: "second one",
        3: "second one",
    }
    assert all(f.finish_reason is FinishReason.STOP for f in got.finals.values())
    assert got.usage and got.usage["prompt_tokens"] == len(a) + len(b)
    assert got.usage["completion_tokens"] == 2 * (len(a) + 1) + 2 * (len(b) + 1)


def test_cancel_before_start_ends_the_stream(stack: Settings, tokenizer: Tokenizer) -> None:
    client = Client(stack)
    record = make_record(stack, [[100, 101, 102]])
    client.store.create(record)  # handed to the streamers, but no task sent yet
    client.store.cancel(record.request_id)
    client.store.submit(record, client.celery)  # the task now finds it cancelled
    got = collect(client.events(record.request_id, timeout_s=15))
    assert got.finals[0].finish_reason is FinishReason.CANCELLED


def test_deadline_ends_with_error_event(
    redis_server: RedisServer, models_dir: Path, tmp_path: Path
) -> None:
    settings = isolated_settings(redis_server.url, models_dir, echo_tokens_per_second=10.0)
    with worker_process(settings, tmp_path), streamer_process(settings, tmp_path):
        record = make_record(settings, [list(range(100, 300))], max_tokens=150, deadline_s=1.5)
        got = Client(settings).run(record, timeout_s=15)
    assert got.finals[0].finish_reason is FinishReason.ERROR
    assert got.finals[0].code == 504


def test_no_worker_for_model_fails_with_503(
    redis_server: RedisServer, models_dir: Path, tmp_path: Path
) -> None:
    settings = isolated_settings(redis_server.url, models_dir, no_worker_timeout_s=1.0)
    with streamer_process(settings, tmp_path):
        record = make_record(settings, [[100, 101]])
        got = Client(settings).run(record, timeout_s=15)
    assert [e.code for e in got.errors] == [503]
    assert "No worker" in (got.errors[0].error or "")


def _pid_from_member(member: str) -> int:
    # worker/streamer ids are "<host>-<pid>-<random>"
    return int(member.rsplit("-", 2)[-2])


def test_worker_killed_mid_request_resumes_on_another(
    redis_server: RedisServer, models_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    settings = isolated_settings(
        redis_server.url, models_dir, echo_tokens_per_second=15.0, lease_ttl_s=1.5
    )
    client = Client(settings)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    record = make_record(settings, [ids], n=2, max_tokens=200)
    with (
        worker_process(settings, tmp_path, name="w1") as w1,
        worker_process(settings, tmp_path, name="w2") as w2,
        streamer_process(settings, tmp_path),
    ):
        client.submit(record)
        rid = record.request_id
        wait_for(
            lambda: sum(len(p.token_ids) for p in client.store.progress(rid, 2)) >= 8,
            20,
            "tokens to flow",
        )
        holder = client.redis.hget(client.store.keys.request(rid), "worker").decode()
        victim = {w1.pid: w1, w2.pid: w2}[_pid_from_member(holder.rsplit(":", 1)[0])]
        victim.kill()
        killed_at = time.time()
        got = collect(client.events(rid, timeout_s=40))
    progress = client.store.progress(rid, 2)
    assert [p.token_ids for p in progress] == [[*ids, EOS]] * 2, "gapless, duplicate-free"
    assert all(p.finish is EngineFinish.EOS for p in progress)
    assert got.texts == {0: TEXT, 1: TEXT}
    assert client.store.state(rid) is not None and client.store.state(rid)[1] == 1
    # Resumed within 10 s: the first token of attempt 1 came soon after the kill.
    first_resumed = next(eid for eid, a, _d in client.store.read_tokens(rid) if a == 1)
    assert int(first_resumed.split("-")[0]) / 1000 - killed_at < 10


def stop_the_streamer_mid_request(
    redis_server: RedisServer,
    models_dir: Path,
    tokenizer: Tokenizer,
    tmp_path: Path,
    *,
    sig: signal.Signals,
    takeover_s: float,
) -> tuple[Any, str, float, int]:
    """Two streamers; once a request's first text is out, ``sig`` to the one decoding
    it. Returns what the client got, that streamer's name, the longest the client then
    waited for text, and the streamer's exit status."""
    settings = isolated_settings(
        redis_server.url, models_dir, echo_tokens_per_second=15.0, streamer_takeover_s=takeover_s
    )
    client = Client(settings)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    record = make_record(settings, [ids], max_tokens=200)
    with (
        worker_process(settings, tmp_path),
        streamer_process(settings, tmp_path, name="s1") as s1,
        streamer_process(settings, tmp_path, name="s2") as s2,
    ):
        client.submit(record)
        events = client.events(record.request_id, timeout_s=40)
        seen: list[OutputEvent] = []
        for ev in events:
            seen.append(ev)
            if sum(len(e.text) for e in seen) >= 15:
                break
        pending = client.redis.xpending_range(
            client.store.keys.new_requests, GROUP, min="-", max="+", count=10
        )
        owner = pending[0]["consumer"].decode()
        victim = {s1.pid: s1, s2.pid: s2}[_pid_from_member(owner)]
        gap, last = 0.0, time.monotonic()
        os.kill(victim.pid, sig)
        code = victim.popen.wait(10)
        rest: list[OutputEvent] = []
        for ev in events:
            if ev.text:
                now = time.monotonic()
                gap, last = max(gap, now - last), now
            rest.append(ev)
        return collect(iter(seen + rest)), owner, gap, code


def test_streamer_killed_mid_request_is_taken_over(
    redis_server: RedisServer, models_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    got, owner, _gap, _code = stop_the_streamer_mid_request(
        redis_server, models_dir, tokenizer, tmp_path, sig=signal.SIGKILL, takeover_s=2.0
    )
    assert got.texts == {0: TEXT}
    assert got.finals[0].finish_reason is FinishReason.STOP
    assert got.usage is not None and got.usage["streamer"] != owner


def test_two_streamers_share_the_load(
    redis_server: RedisServer, models_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    settings = isolated_settings(redis_server.url, models_dir, echo_tokens_per_second=50.0)
    client = Client(settings)
    ids = tokenizer.encode("a few words to echo back", add_special_tokens=False).ids
    records = [make_record(settings, [ids]) for _ in range(16)]
    with (
        worker_process(settings, tmp_path),
        streamer_process(settings, tmp_path),
        streamer_process(settings, tmp_path),
    ):
        for r in records:
            client.submit(r)
        results = [collect(client.events(r.request_id)) for r in records]
    assert all(r.texts == {0: "a few words to echo back"} for r in results)
    by_streamer = {r.usage["streamer"] for r in results if r.usage}
    assert len(by_streamer) == 2


def test_a_streamer_stopped_by_sigterm_hands_its_requests_over_at_once(
    redis_server: RedisServer, models_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """A drain (issue 43): the stopping streamer writes what it decoded, exits 0 and
    marks its hand-off entries idle, so the other streamer takes the request over at its
    next look instead of a takeover time (5 s here) later; the text is exact. Measured:
    the stream stood still 0.7 s, against 5.8 s without the hand-over."""
    got, owner, gap, code = stop_the_streamer_mid_request(
        redis_server, models_dir, tokenizer, tmp_path, sig=signal.SIGTERM, takeover_s=5.0
    )
    assert code == 0
    assert got.texts == {0: TEXT}
    assert got.usage is not None and got.usage["streamer"] != owner
    assert gap < 3.0, f"the stream stood still {gap:.1f} s after the SIGTERM"
