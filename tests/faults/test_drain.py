"""SIGTERM mid-stream, for each kind of process: the graceful drain (issue 43).

Real processes: redis-server, Celery workers (echo engine at a finite rate, so every
reply streams for seconds), streamers, web servers and batch drivers, each started here
and stopped by the PID it started. Eight streams run when one process gets SIGTERM with
a short ``drain_s``; what must hold:

- every client's text is exact (its own prompt, echoed), ends with its finish, and no
  request gets a 5xx or an error event;
- the process that drained exits 0 within its drain time (and a margin for closing);
- a worker's requests go on elsewhere sooner than a lease expiry would let them (its
  leases are given back when the drain runs out): measured as the longest pause
  between two text events of any stream, logged;
- a web process's open streams end without their final event when the drain runs out,
  and their clients resume on another web process (SSE ``Last-Event-ID``, the
  WebSocket's ``resume`` after a 1012 close) with exact text.
"""

from __future__ import annotations

import itertools
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket

from broker.connection import redis_client
from broker.keys import Keys
from broker.registry import batcher_registry
from broker.requests import RequestStore
from tests.faults.web_clients import words
from tests.stack import (
    Proc,
    Stack,
    batcher_process,
    busiest,
    full_stack,
    isolated_settings,
    wait_for,
    web_process,
    web_settings,
)

pytestmark = pytest.mark.faults
logger = logging.getLogger(__name__)

STREAMS = 8
RATE = 20.0  # echo tokens per second: a reply of ``prompt(i)`` streams for ~4 s
DRAIN_S = 1.0
LEASE_TTL_S = 4.0
WAIT_S = 60.0


def prompt(i: int) -> str:
    return words(f"stream {i} 🦊 東京", 36)


# -- an SSE client that can resume ------------------------------------------------------


@dataclass
class SseClient:
    """One chat stream as a client reads it: every complete event with its id and
    arrival time, resumed with ``Last-Event-ID`` (``resume``) when a connection ends
    without ``[DONE]``."""

    base: str
    content: str
    request_id: str | None = None
    events: list[tuple[str | None, dict[str, Any], float]] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    connections: int = 0
    done: bool = False
    errors: list[Any] = field(default_factory=list)

    def text(self) -> str:
        return "".join(
            c["delta"].get("content") or "" for _, p, _ in self.events for c in p["choices"]
        )

    def text_times(self) -> list[float]:
        return [
            t for _, p, t in self.events if any(c["delta"].get("content") for c in p["choices"])
        ]

    def finishes(self) -> list[str]:
        return [
            c["finish_reason"]
            for _, p, _ in self.events
            for c in p["choices"]
            if c["finish_reason"]
        ]

    def start(self) -> None:
        resp = requests.post(
            f"{self.base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": self.content}], "stream": True},
            stream=True,
            timeout=(5, WAIT_S),
        )
        self.request_id = resp.headers.get("x-request-id")
        self._read(resp)

    def resume(self, base: str) -> None:
        last = next((i for i, _, _ in reversed(self.events) if i), None)
        headers = {"Last-Event-ID": last} if last else {}
        resp = requests.get(
            f"{base}/v1/streams/{self.request_id}",
            headers=headers,
            stream=True,
            timeout=(5, WAIT_S),
        )
        self._read(resp)

    def _read(self, resp: requests.Response) -> None:
        self.connections += 1
        self.statuses.append(resp.status_code)
        if resp.status_code != 200:
            self.errors.append(resp.text)
            return
        event_id: str | None = None
        try:
            for line in resp.iter_lines():
                raw = line.decode()
                if raw.startswith("id:"):
                    event_id = raw[3:].strip()
                elif raw.startswith("data:"):
                    data = raw[5:].strip()
                    if data == "[DONE]":
                        self.done = True
                        return
                    payload = json.loads(data)
                    if "error" in payload:
                        self.errors.append(payload)
                    else:
                        self.events.append((event_id, payload, time.monotonic()))
                    event_id = None
        except requests.RequestException as exc:
            logger.info("SSE connection of %s ended: %r", self.request_id, exc)
        finally:
            resp.close()


def run_clients(
    base: str, *, resume_on: str | None = None
) -> tuple[list[SseClient], list[threading.Thread]]:
    """``STREAMS`` chat streams on ``base``, each in a thread; one that ends without
    ``[DONE]`` resumes on ``resume_on`` (until done, at most three times)."""
    clients = [SseClient(base, prompt(i)) for i in range(STREAMS)]

    def follow(c: SseClient) -> None:
        c.start()
        while resume_on is not None and not c.done and not c.errors and c.connections < 4:
            c.resume(resume_on)

    threads = [threading.Thread(target=follow, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    return clients, threads


def wait_streaming(clients: list[SseClient], texts: int = 3) -> None:
    wait_for(
        lambda: all(len(c.text_times()) >= texts for c in clients),
        WAIT_S,
        "every stream to be under way",
    )


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a client is still reading"


def assert_exact(clients: list[SseClient]) -> None:
    for c in clients:
        assert not c.errors and all(s == 200 for s in c.statuses), (c.statuses, c.errors)
        assert c.done, f"{c.request_id}: no [DONE]"
        assert c.text() == c.content, c.request_id
        assert c.finishes() == ["stop"], c.finishes()


def longest_pause(clients: list[SseClient]) -> float:
    pauses = [b - a for c in clients for a, b in itertools.pairwise(c.text_times())]
    return max(pauses, default=0.0)


def sigterm_and_wait(proc: Proc, within_s: float) -> tuple[int, float]:
    """SIGTERM ``proc``; its exit status and how long it took."""
    started = time.monotonic()
    proc.popen.send_signal(signal.SIGTERM)
    code = proc.popen.wait(within_s + 15)
    return code, time.monotonic() - started


@pytest.fixture
def drain_stack(models_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=RATE,
        drain_s=DRAIN_S,
        lease_ttl_s=LEASE_TTL_S,
        resume_grace_s=30.0,
        sse_keepalive_s=0.5,
        web_workers=1,
        web_threads=24,
    )
    with full_stack(
        settings, tmp_path / "logs", workers=("w1", "w2"), streamers=("s1", "s2")
    ) as stack:
        yield stack


def sigterm_mid_stream(stack: Stack, kind: str) -> tuple[list[SseClient], float]:
    """``STREAMS`` streams; SIGTERM to the process of ``kind`` holding most of them once
    all are under way. It must exit 0 within its drain time (and a margin), and every
    text be exact; the clients and the longest pause between two text events."""
    clients, threads = run_clients(stack.base_url)
    wait_streaming(clients)
    proc = busiest(stack, kind, STREAMS)
    code, took = sigterm_and_wait(proc, DRAIN_S)
    join_all(threads)
    pause = longest_pause(clients)
    logger.warning("%s stopped in %.2f s (exit %d); longest pause %.2f s", kind, took, code, pause)
    assert code == 0, proc.output()
    assert took < DRAIN_S + 5.0
    assert_exact(clients)
    return clients, pause


# -- the worker ---------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_draining_worker_hands_its_requests_over(drain_stack: Stack) -> None:
    """Measured here: the drained worker exits 0 about 1.25 s after SIGTERM (drain 1 s);
    the longest pause in any stream is 0.2-0.6 s, where a lease expiry alone would take
    4 s (``LEASE_TTL_S``) plus the watchdog's look."""
    clients, pause = sigterm_mid_stream(drain_stack, "worker")
    assert pause < LEASE_TTL_S, f"a stream stood still {pause:.2f} s"
    client = redis_client(drain_stack.settings.redis_url, max_connections=2)
    try:
        store = RequestStore(client, Keys(drain_stack.settings.key_prefix))
        attempts = [store.state(str(c.request_id)) for c in clients]
    finally:
        client.connection_pool.disconnect()
    handed = sum(1 for a in attempts if a is not None and a[1] > 0)
    assert handed > 0, f"nothing was handed over: {attempts}"


# -- the streamer -------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_draining_streamer_hands_its_requests_over(drain_stack: Stack) -> None:
    _clients, pause = sigterm_mid_stream(drain_stack, "streamer")
    assert pause < drain_stack.settings.streamer_takeover_s


# -- the web process ----------------------------------------------------------------------


@dataclass
class WsClient:
    """One WebSocket chat, resumed on another process after a close."""

    content: str
    request_id: str | None = None
    deltas: list[dict[str, Any]] = field(default_factory=list)
    finals: list[dict[str, Any]] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    close_codes: list[int | None] = field(default_factory=list)
    done: bool = False

    def text(self) -> str:
        return "".join(d["text"] for d in self.deltas)

    def run(self, base: str, resume_on: str) -> None:
        ws = websocket.create_connection(ws_url(base), timeout=WAIT_S)
        ws.send(
            json.dumps(
                {"type": "chat", "id": "q", "messages": [{"role": "user", "content": self.content}]}
            )
        )
        self._read(ws)
        while not self.done and not self.errors and len(self.close_codes) < 4:
            ws = websocket.create_connection(ws_url(resume_on), timeout=WAIT_S)
            cursor = max((m["cursor"] for m in self.deltas), key=cursor_key, default=None)
            ws.send(
                json.dumps(
                    {"type": "resume", "id": "q", "request_id": self.request_id, "cursor": cursor}
                )
            )
            self._read(ws)

    def _read(self, ws: websocket.WebSocket) -> None:
        try:
            while True:
                opcode, data = ws.recv_data()
                if opcode == websocket.ABNF.OPCODE_CLOSE:
                    self.close_codes.append(
                        int.from_bytes(data[:2], "big") if len(data) >= 2 else None
                    )
                    return
                msg = json.loads(data)
                kind = msg["type"]
                if kind == "started":
                    self.request_id = msg["request_id"]
                elif kind == "delta":
                    self.deltas.append(msg)
                elif kind == "final":
                    self.finals.append(msg)
                elif kind == "error":
                    self.errors.append(msg)
                elif kind == "done":
                    self.done = True
                    return
        except (websocket.WebSocketException, OSError) as exc:
            logger.info("WebSocket ended: %r", exc)
            self.close_codes.append(None)
        finally:
            ws.close()  # returns at once when the server closed first: then shutdown
            ws.shutdown()  # type: ignore[no-untyped-call]  # closes the socket itself


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://", 1) + "/v1/ws"


def cursor_key(cursor: str) -> tuple[int, int]:
    chunk, _, index = cursor.partition("/")
    return int(chunk), int(index)


@pytest.mark.timeout(180)
def test_a_draining_web_process_hands_its_streams_to_another(drain_stack: Stack) -> None:
    """Six SSE streams and two WebSocket chats on web A; A gets SIGTERM. Once its drain
    time is up their connections end (SSE without ``[DONE]``, the sockets with 1012)
    and every client resumes on web B with exact text; A exits 0."""
    from web.__main__ import STREAMS_END_S

    b_url = drain_stack.base_url
    a_settings = web_settings(drain_stack.settings)
    a_url = f"http://{a_settings.host}:{a_settings.port}"
    with web_process(a_settings, drain_stack.log_dir, name="web-a") as web_a:
        clients, threads = run_clients(a_url, resume_on=b_url)
        sockets = [WsClient(prompt(100 + i)) for i in range(2)]
        ws_threads = [
            threading.Thread(target=s.run, args=(a_url, b_url), daemon=True) for s in sockets
        ]
        for t in ws_threads:
            t.start()
        wait_streaming(clients[: STREAMS - 2])
        wait_for(lambda: all(len(s.deltas) >= 3 for s in sockets), WAIT_S, "the sockets to stream")
        code, took = sigterm_and_wait(web_a, DRAIN_S + STREAMS_END_S)
        join_all(threads + ws_threads)
    logger.warning("web A stopped in %.2f s (exit %d)", took, code)
    assert code == 0, web_a.output()
    assert took < DRAIN_S + STREAMS_END_S + 3.0
    assert_exact(clients)
    assert any(c.connections > 1 for c in clients), "no stream was handed over"
    for s in sockets:
        assert not s.errors and s.done, (s.errors, s.close_codes)
        assert s.text() == s.content
        assert [f["finish_reason"] for f in s.finals] == ["stop"]
        assert s.close_codes[:1] == [1012], s.close_codes


@pytest.mark.timeout(120)
def test_a_stream_nobody_resumes_is_cancelled_after_its_web_process_stopped(
    drain_stack: Stack,
) -> None:
    """Web A hands a stream over and exits; its client never comes back. Its resume
    grace (2 s here) runs out after A is gone, so the cancel is another web process's
    (``broker.abandon``: the deadline is in Redis, found by web B's sweep): the worker
    stops instead of generating the rest of a ~25 s reply for nobody."""
    from broker.abandon import SWEEP_S
    from web.__main__ import STREAMS_END_S

    grace_s = 6.0
    a_settings = web_settings(drain_stack.settings, resume_grace_s=grace_s)
    a_url = f"http://{a_settings.host}:{a_settings.port}"
    client = SseClient(a_url, words("nobody resumes", 250))  # ~500 tokens at 20 a second
    with web_process(a_settings, drain_stack.log_dir, name="web-a") as web_a:
        reader = threading.Thread(target=client.start, daemon=True)
        reader.start()
        wait_streaming([client])
        code, _took = sigterm_and_wait(web_a, DRAIN_S + STREAMS_END_S)
        stopped = time.monotonic()
        reader.join(WAIT_S)
    assert code == 0, web_a.output()
    assert client.request_id and not client.done and not client.errors
    rid = client.request_id
    redis = redis_client(drain_stack.settings.redis_url, max_connections=2)
    try:
        store = RequestStore(redis, Keys(drain_stack.settings.key_prefix))
        assert not store.is_cancelled(rid)  # kept for a resume while the grace runs
        wait_for(lambda: store.is_cancelled(rid), grace_s + SWEEP_S + 5.0, "the cancel")
        took = time.monotonic() - stopped
        logger.warning("cancelled %.2f s after web A stopped (grace %.1f s)", took, grace_s)
        assert redis.zcard(Keys(drain_stack.settings.key_prefix).abandoned) == 0
    finally:
        redis.connection_pool.disconnect()


@pytest.mark.timeout(150)
def test_a_sigkilled_web_process_s_stream_nobody_resumes_is_cancelled(
    drain_stack: Stack,
) -> None:
    """Web A is SIGKILLed (master and workers) mid-stream: it never counts its client
    as gone. Web C, which takes a process silent for 3 s for dead, counts A's client
    out of the stream, and cancels it after the grace (6 s) since A's last heartbeat,
    long before the ~60 s reply would have ended (``broker.abandon``). The stack's own
    web process (grace 30 s, 20 s to take a process for dead) is slower, so C does it."""
    from broker.abandon import SWEEP_S

    grace_s, dead_after_s = 6.0, 3.0
    c_settings = web_settings(
        drain_stack.settings, resume_grace_s=grace_s, web_dead_after_s=dead_after_s
    )
    a_settings = web_settings(drain_stack.settings)
    client = SseClient(f"http://{a_settings.host}:{a_settings.port}", words("killed", 600))
    keys = Keys(drain_stack.settings.key_prefix)
    redis = redis_client(drain_stack.settings.redis_url, max_connections=2)
    try:
        store = RequestStore(redis, keys)
        with (
            web_process(c_settings, drain_stack.log_dir, name="web-c") as web_c,
            web_process(a_settings, drain_stack.log_dir, name="web-a") as web_a,
        ):
            reader = threading.Thread(target=client.start, daemon=True)
            reader.start()
            wait_streaming([client])
            web_a.kill_group()
            killed = time.monotonic()
            reader.join(WAIT_S)
            rid = client.request_id
            assert rid and not client.done
            assert not store.is_cancelled(rid)  # kept for a resume while the grace runs
            within = dead_after_s + 2 * SWEEP_S + grace_s + 5.0
            wait_for(lambda: store.is_cancelled(rid), within, "the cancel")
            took = time.monotonic() - killed
            logger.warning("cancelled %.2f s after web A was killed (grace %.1f s)", took, grace_s)
            assert took < 30.0, web_c.output()  # the reply would stream for ~60 s
            assert int(redis.get(keys.followers(rid)) or 0) == 0
            assert redis.zcard(keys.abandoned) == 0
            assert redis.zcard(keys.web_processes) == 2  # B and C: A was taken out
    finally:
        redis.connection_pool.disconnect()


# -- the batch driver ---------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_draining_batch_driver_releases_its_batch(drain_stack: Stack) -> None:
    """Eight lines running; the driver holding the batch gets SIGTERM and exits 0 at
    once; the other driver takes the batch over and it completes, every line exact."""
    base = drain_stack.base_url
    for name in ("b1", "b2"):
        drain_stack.start(
            name, batcher_process(drain_stack.settings, drain_stack.log_dir, name=name)
        )
    contents = [prompt(200 + i) for i in range(STREAMS)]
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": c}], "max_tokens": 1000},
        }
        for i, c in enumerate(contents)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    up = requests.post(
        f"{base}/v1/files",
        files={"file": ("in.jsonl", data)},
        data={"purpose": "batch"},
        timeout=10,
    )
    assert up.status_code == 200, up.text
    created = requests.post(
        f"{base}/v1/batches",
        json={
            "input_file_id": up.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        timeout=10,
    )
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]

    def batch() -> dict[str, Any]:
        with requests.get(f"{base}/v1/batches/{batch_id}", timeout=5) as resp:
            body: dict[str, Any] = resp.json()
        return body

    client = redis_client(drain_stack.settings.redis_url, max_connections=2)
    drivers = batcher_registry(client, Keys(drain_stack.settings.key_prefix))

    def holder() -> int | None:
        return next((d.pid for d in drivers.live() if batch_id in d.batches), None)

    try:
        wait_for(lambda: batch()["status"] == "in_progress", WAIT_S, "the batch to start")
        pid: Any = wait_for(holder, WAIT_S, "a driver to hold the batch")
        time.sleep(1.0)  # its lines stream meanwhile
        first = next(p for p in drain_stack.procs.values() if p.pid == pid)
        code, took = sigterm_and_wait(first, DRAIN_S)
        logger.warning("batch driver stopped in %.2f s (exit %d)", took, code)
        assert code == 0, first.output()
        assert took < DRAIN_S + 5.0
        ended: Any = wait_for(
            lambda: (
                (b := batch())["status"] in {"completed", "failed", "cancelled", "expired"} and b
            ),
            WAIT_S,
            "the batch to end",
            interval=0.25,
        )
        assert ended["status"] == "completed", ended
        assert ended["request_counts"] == {"total": STREAMS, "completed": STREAMS, "failed": 0}
        out = requests.get(f"{base}/v1/files/{ended['output_file_id']}/content", timeout=10)
        got = {
            line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"]
            for line in map(json.loads, out.text.splitlines())
        }
        assert got == {f"line-{i}": c for i, c in enumerate(contents)}
        assert first.pid not in {d.pid for d in drivers.live()}
    finally:
        client.connection_pool.disconnect()
