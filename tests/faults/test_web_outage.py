"""The web tier through a Redis outage, a dead last worker and a malformed output entry,
with real processes: redis-server (with and without AOF), a Celery worker (echo engine
at a finite rate), a streamer and the web server (gunicorn), each started by the test
and killed by the PID it started.

What must hold (issue #10, items 2, 3, 5 and 6, the web side):

- during an outage every generation route answers 503 + Retry-After within 1 s (never
  a 500, never a hang), so do the Files/Batches routes and a resumed stream; ``/ready``
  is 503 with Retry-After, ``/health`` stays 200; a WebSocket client gets an error and
  ``done`` per request and its socket stays open (a ping still gets its pong);
- in-flight streams (SSE, non-streaming, WebSocket) finish with exactly their text when
  Redis kept its data, or end with a clear error; without persistence each ends with a
  clear error; none hangs more than 10 s after Redis is back; the web process, its
  gunicorn workers and their output hubs survive, and new requests succeed within 10 s;
- with its last worker dead, a new request gets 503 before any SSE starts once the
  worker's registration expired, and one admitted just before ends with an error event;
- a malformed entry in one request's output stream ends that request with an error
  event; the web process keeps serving everyone else.

Each case logs what it measured (``pytest -s`` or ``--log-cli-level=WARNING``)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests

from app.settings import Settings
from broker.connection import redis_client
from broker.keys import Keys
from broker.registry import worker_registry
from broker.run import LOST_MESSAGE
from broker.runner import READY_CACHE_S
from broker.server import RedisServer
from tests.e2e.test_websocket import ChatClient
from tests.faults.conftest import (
    LEASE_TTL_S,
    NO_WORKER_TIMEOUT_S,
    REGISTRATION_TTL_S,
    last_worker_settings,
)
from tests.faults.web_clients import (
    CHAT,
    COMPLETIONS,
    Probe,
    Stream,
    Unary,
    body_for,
    children,
    probe,
    start_stream,
    start_unary,
    words,
)
from tests.stack import (
    Proc,
    full_stack,
    inject_output_chunk,
    isolated_settings,
    streamer_process,
    wait_for,
)

pytestmark = pytest.mark.faults
logger = logging.getLogger(__name__)

RATE = 15.0  # echo tokens per second per request: a ~90-token answer streams for ~6 s
OUTAGE_S = 3.0
ANSWER_WITHIN_S = 1.0  # every route during the outage
BACK_WITHIN_S = 10.0  # in-flight requests end, new ones succeed, after Redis is back
# Routes that need no Redis: liveness, the model list, metrics (cluster gauges are
# skipped while Redis is away, the process's own are still served).
ALWAYS_UP = ("GET /health", "GET /v1/models", "GET /metrics")


def base_url(settings: Settings) -> str:
    return f"http://{settings.host}:{settings.port}"


def ws_url(settings: Settings) -> str:
    return f"ws://{settings.host}:{settings.port}/v1/ws"


def chat_text(base: str, model: str, content: str, timeout: float = 10) -> tuple[Any, str | None]:
    """A non-streaming chat: (status or exception name, text when 200)."""
    try:
        resp = requests.post(
            base + CHAT, json=body_for(CHAT, model, content, stream=False), timeout=timeout
        )
    except requests.RequestException as exc:
        return type(exc).__name__, None
    if resp.status_code != 200:
        return resp.status_code, None
    return 200, resp.json()["choices"][0]["message"]["content"]


def outage_probes(base: str, model: str, file_id: str, batch_id: str) -> list[Probe]:
    """One request to every route that needs Redis (and to the two that must not)."""
    upload = {"file": ("b.jsonl", b'{"custom_id": "x"}\n')}
    purpose = {"purpose": "batch"}
    new_batch = {
        "input_file_id": file_id,
        "endpoint": CHAT,
        "completion_window": "24h",
    }
    out = [
        probe("POST", base + r, f"POST {r} stream={s}", json=body_for(r, model, "hi", stream=s))
        for r in (CHAT, COMPLETIONS)
        for s in (True, False)
    ]
    out += [
        probe("GET", base + "/ready", "GET /ready"),
        probe("GET", base + "/health", "GET /health"),
        probe("GET", base + "/v1/models", "GET /v1/models"),
        probe("GET", base + "/metrics", "GET /metrics"),
        probe("GET", base + "/v1/streams/abc", "GET /v1/streams/<id>"),
        probe("GET", base + "/v1/files", "GET /v1/files"),
        probe("POST", base + "/v1/files", "POST /v1/files", files=upload, data=purpose),
        probe("GET", base + f"/v1/files/{file_id}", "GET /v1/files/<id>"),
        probe("GET", base + f"/v1/files/{file_id}/content", "GET /v1/files/<id>/content"),
        probe("GET", base + "/v1/batches", "GET /v1/batches"),
        probe("POST", base + "/v1/batches", "POST /v1/batches", json=new_batch),
        probe("GET", base + f"/v1/batches/{batch_id}", "GET /v1/batches/<id>"),
        probe("POST", base + f"/v1/batches/{batch_id}/cancel", "POST /v1/batches/<id>/cancel"),
    ]
    return out


def wrong_outage_answers(probes: list[Probe]) -> list[str]:
    """Every probe that is not what a client must get during an outage."""
    bad = []
    for p in probes:
        if p.took_s > ANSWER_WITHIN_S:
            bad.append(f"slow: {p}")
        if p.what in ALWAYS_UP:
            if p.status != 200:
                bad.append(f"not 200: {p}")
            continue
        if p.status != 503 or p.retry_after is None:
            bad.append(f"not 503 + Retry-After: {p}")
            continue
        error = json.loads(p.body).get("error", {})
        if error.get("type") != "service_unavailable_error":
            bad.append(f"not an OpenAI error body: {p}")
    return bad


def wait_ready(base: str, timeout: float = 30) -> None:
    def ready() -> bool:
        try:
            return requests.get(base + "/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    wait_for(ready, timeout, "the web server to be ready", interval=0.2)


def web_log(web: Proc) -> str:
    return web.log.read_text(errors="replace")


# -- Redis killed and restarted under the web tier -------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("appendonly", "streamer_lost"),
    [(True, False), (False, False), (False, True)],
    # streamer-lost: the streamer dies with Redis's data, so no one writes the requests'
    # error events: each web run's own guard must notice its request is gone (LOST_CHECK_S).
    ids=["aof", "no-persistence", "no-persistence-streamer-lost"],
)
def test_web_tier_through_a_redis_restart(
    appendonly: bool, streamer_lost: bool, models_dir: Path, tmp_path: Path
) -> None:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=RATE,
        web_workers=2,
        web_threads=16,
        sse_keepalive_s=1.0,
        worker_slots=8,
    )
    server = RedisServer(appendonly=appendonly)
    with full_stack(settings, tmp_path, redis_server=server) as stack:
        settings, procs, report = stack.settings, stack.procs, stack.logs
        model, base = settings.served_name, base_url(settings)
        wait_ready(base)
        assert chat_text(base, model, "warm up", timeout=30) == (200, "warm up"), report()
        gunicorn_workers = children(procs["web"].pid)
        assert len(gunicorn_workers) == 2, gunicorn_workers
        # A file and a batch the Files/Batches probes can name (a real id each).
        file_id = requests.post(
            base + "/v1/files",
            files={"file": ("in.jsonl", b"")},
            data={"purpose": "batch"},
            timeout=10,
        ).json()["id"]
        batch_id = f"batch_{uuid.uuid4().hex}"

        # In flight when Redis dies: SSE on both routes, non-streaming, a WebSocket chat.
        streams = [Stream(CHAT, words(f"chat {i}")) for i in range(3)]
        streams.append(Stream(COMPLETIONS, words("completion")))
        unaries = [Unary(CHAT, words("unary chat")), Unary(COMPLETIONS, words("unary compl"))]
        for s in streams:
            start_stream(base, model, s)
        for u in unaries:
            start_unary(base, model, u)
        ws = ChatClient(ws_url(settings))
        stack.callback(ws.close)
        ws_content = words("websocket")
        ws.chat("inflight", ws_content, max_tokens=1000)
        ws.until(lambda: bool(ws.reply("inflight").deltas), timeout=30)
        for s in streams:
            assert s.started.wait(30), f"a stream got no text before the kill\n{report()}"
        assert not any(s.ended.is_set() for s in streams), "streams too short to be mid-stream"

        web_lines_before = len(web_log(procs["web"]).splitlines())
        server.kill()
        killed = time.monotonic()
        if streamer_lost:
            procs["streamer"].kill()
            # Its replacement starts now and connects once Redis is back.
            stack.start(
                "streamer", streamer_process(settings, tmp_path, name="streamer2", wait=False)
            )
        probes: list[Probe] = []
        ws_during: list[str] = []
        while time.monotonic() - killed < OUTAGE_S:
            probes += outage_probes(base, model, file_id, batch_id)
            wid = f"during-{len(ws_during)}"
            ws_during.append(wid)
            ws.chat(wid, "during the outage")
            ws.send({"type": "ping", "id": f"ping-{wid}"})
            time.sleep(0.2)
        pongs_before = len(ws.untagged)
        ws.until(
            lambda: (
                all(ws.reply(w).done for w in ws_during)
                and sum(m.get("type") == "pong" for m in ws.untagged) >= len(ws_during)
            ),
            timeout=10,
        )
        ws_answered = time.monotonic() - killed

        server.start()
        back = time.monotonic()
        first_ok: float | None = None
        attempts: list[str] = []
        while time.monotonic() - back < BACK_WITHIN_S + 5:
            sent = time.monotonic()
            status, text = chat_text(base, model, "after the restart")
            attempts.append(f"{sent - back:.1f}s: {status} in {time.monotonic() - sent:.2f}s")
            if text == "after the restart":
                first_ok = time.monotonic() - back
                break
            time.sleep(0.25)

        for s in streams:
            s.ended.wait(max(0.0, back + BACK_WITHIN_S + 5 - time.monotonic()))
        for u in unaries:
            u.ended.wait(max(0.0, back + BACK_WITHIN_S + 5 - time.monotonic()))
        ws.until(lambda: ws.reply("inflight").done, timeout=max(1.0, back + 15 - time.monotonic()))
        inflight = ws.reply("inflight")
        ws_outcome = (
            "error"
            if inflight.errors and ws_content.startswith(inflight.text())
            else "exact"
            if inflight.text() == ws_content and inflight.usage is not None
            else "broken"
        )
        ws_ended = (inflight.done_at or back + 99) - back
        # The same socket serves a new request after the outage.
        ws.chat("after", "socket still open")
        ws.wait_done("after", timeout=15)

        outcomes = [s.outcome() for s in streams] + [u.outcome() for u in unaries] + [ws_outcome]
        tally = {k: outcomes.count(k) for k in ("exact", "error", "hung", "wrong", "broken")}
        ended = [s.ended_at for s in streams] + [u.ended_at for u in unaries]
        late = [(t or back + 99) - back for t in ended] + [ws_ended]
        log = web_log(procs["web"])
        web_lines = len(log.splitlines()) - web_lines_before
        details = "\n".join(
            [s.describe() for s in streams]
            + [u.describe() for u in unaries]
            + [f"websocket {ws_outcome}: errors={inflight.errors} text={len(inflight.text())}"]
        )
        slowest = max(probes, key=lambda p: p.took_s)
        logger.warning(
            "redis restart under the web tier (%s%s, %.0f s down): %d probes during the outage, "
            "slowest %s; websocket errors+done and pongs %.1f s after the kill; in-flight %s, "
            "the last ended %.1f s after redis was back; first new request ok %s s after "
            "redis was back (%s); %d web log lines since the kill\n%s",
            "aof" if appendonly else "no persistence",
            ", streamer lost" if streamer_lost else "",
            OUTAGE_S,
            len(probes),
            slowest,
            ws_answered,
            tally,
            max(late),
            f"{first_ok:.2f}" if first_ok is not None else "never",
            "; ".join(attempts),
            web_lines,
            details,
        )

        bad = wrong_outage_answers(probes)
        assert not bad, "\n".join(bad[:20]) + "\n" + report()
        for wid in ws_during:
            reply = ws.reply(wid)
            assert reply.done and len(reply.errors) == 1, (wid, reply)
            assert reply.errors[0]["error"]["type"] == "service_unavailable_error", reply
        assert len(ws.untagged) >= pongs_before
        assert ws.reply("after").text() == "socket still open"

        dead = [n for n, p in procs.items() if not p.alive()]
        assert not dead, f"{dead} died\n{report()}"
        assert children(procs["web"].pid) == gunicorn_workers, "a gunicorn worker was replaced"
        assert "unhandled error" not in log, log[-4000:]
        # A few lines per gunicorn worker for the whole outage, not one per request.
        assert web_lines < 40, log[-4000:]
        assert tally["hung"] == tally["wrong"] == tally["broken"] == 0, f"{details}\n{report()}"
        assert max(late) < BACK_WITHIN_S, f"{details}\n{report()}"
        if not appendonly:  # records and streams are gone: nothing can finish them
            assert tally["exact"] == 0, details
        if streamer_lost:  # only the web runs' guard could have ended them
            assert details.count(LOST_MESSAGE) == len(outcomes), details
        assert first_ok is not None and first_ok < BACK_WITHIN_S, f"{attempts}\n{report()}"
        # And it keeps serving: a stream on each route, exactly.
        again = [Stream(CHAT, words("again", 10)), Stream(COMPLETIONS, words("again c", 10))]
        for s in again:
            start_stream(base, model, s)
        for s in again:
            s.ended.wait(30)
        assert [s.outcome() for s in again] == ["exact", "exact"], [s.describe() for s in again]


# -- fail fast: the last worker dies -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_fail_fast_after_the_last_worker_dies(models_dir: Path, tmp_path: Path) -> None:
    """A request that was running and one admitted just after the kill (the worker's
    registration still alive) end with an error event; once the registration has
    expired, every new request gets 503 + Retry-After before any SSE starts."""
    settings = last_worker_settings(models_dir, web_workers=1, web_threads=16, sse_keepalive_s=1.0)
    with full_stack(settings, tmp_path) as stack:
        settings, worker, web = stack.settings, stack.procs["worker"], stack.procs["web"]
        model, base = settings.served_name, base_url(settings)
        registry = worker_registry(
            redis_client(settings.redis_url, max_connections=2), Keys(settings.key_prefix)
        )
        wait_ready(base)
        running = Stream(CHAT, words("running"))
        start_stream(base, model, running)
        assert running.started.wait(30), web.output()

        worker.kill()
        killed = time.monotonic()
        admitted = Stream(CHAT, words("admitted"))
        start_stream(base, model, admitted)
        noticed: float | None = None
        probes: list[tuple[float, Probe]] = []
        while time.monotonic() - killed < REGISTRATION_TTL_S + 5:
            if noticed is None and not registry.live():
                noticed = time.monotonic() - killed
            sent = time.monotonic() - killed
            probes.append((sent, stream_head(base, model)))
            if noticed is not None and len([s for s, _ in probes if s > noticed]) >= 6:
                break
            time.sleep(0.5)
        bound = REGISTRATION_TTL_S + NO_WORKER_TIMEOUT_S + LEASE_TTL_S + 4.0
        for s in (running, admitted):
            s.ended.wait(max(0.0, killed + bound + 5 - time.monotonic()))
        assert web.alive()

    ends = {
        name: None if s.ended_at is None else round(s.ended_at - killed, 1)
        for name, s in (("running", running), ("admitted", admitted))
    }
    logger.warning(
        "last worker killed: the registry noticed after %s s (TTL %.0f s); requests in "
        "flight ended (s after the kill) %s: %s / %s; new requests: %s",
        None if noticed is None else f"{noticed:.1f}",
        REGISTRATION_TTL_S,
        ends,
        running.describe(),
        admitted.describe(),
        "; ".join(f"{t:.1f}s {p}" for t, p in probes),
    )
    # Checked every probe (~1.5 s apart while requests are still admitted).
    assert noticed is not None and noticed < REGISTRATION_TTL_S + 2.5
    for s in (running, admitted):
        # An error event in the stream, or (admitted) the 503 before the stream started.
        refused = s.status == 503 and s.failure is not None
        assert s.outcome() == "error" or refused, s.describe()
        assert s.ended_at is not None and s.ended_at - killed < bound, s.describe()
        if s.error is not None:
            assert "No worker" in s.error["message"], s.describe()
    # A web worker reuses a positive readiness answer for READY_CACHE_S.
    after = [p for t, p in probes if t > noticed + READY_CACHE_S]
    assert after, probes
    for p in after:
        assert p.status == 503 and p.retry_after is not None, p
        assert p.took_s < ANSWER_WITHIN_S, p
        assert "application/json" in p.body, p  # an error body, not an event stream


def stream_head(base: str, model: str) -> Probe:
    """A streamed chat's status line and headers only (then hang up): 503 before any
    SSE starts, or 200 once a stream has started. ``body`` is the Content-Type."""
    started = time.monotonic()
    try:
        with requests.post(
            base + CHAT, json=body_for(CHAT, model, "probe", stream=True), stream=True, timeout=5
        ) as resp:
            return Probe(
                "POST /v1/chat/completions stream=True",
                resp.status_code,
                resp.headers.get("Retry-After"),
                time.monotonic() - started,
                resp.headers.get("Content-Type", ""),
            )
    except requests.RequestException as exc:
        return Probe("stream", type(exc).__name__, None, time.monotonic() - started, str(exc))


# -- a poison pill in the web tier's read path ------------------------------------------------


@pytest.mark.timeout(120)
def test_malformed_output_entry_ends_only_its_request(models_dir: Path, tmp_path: Path) -> None:
    """Garbage XADDed to one request's output stream (as a buggy streamer would write it):
    that request ends with an error event (SSE) or its 500 (non-streaming), and its
    generation is cancelled; a concurrent stream and new requests get exactly their
    text, and the web process and its gunicorn workers live on."""
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=15.0,
        web_workers=1,
        web_threads=16,
        sse_keepalive_s=1.0,
    )
    with full_stack(settings, tmp_path) as stack:
        settings, streamer, web = stack.settings, stack.procs["streamer"], stack.procs["web"]
        model, base = settings.served_name, base_url(settings)
        keys = Keys(settings.key_prefix)
        client = redis_client(settings.redis_url, max_connections=2)
        wait_ready(base)
        gunicorn_workers = children(web.pid)
        victim, bystander = Stream(CHAT, words("victim")), Stream(CHAT, words("bystander"))
        for s in (victim, bystander):
            start_stream(base, model, s)
        for s in (victim, bystander):
            assert s.started.wait(30), web.output()
        assert victim.request_id is not None
        inject_output_chunk(client, keys, victim.request_id, b"\x00not json", streamer.pid)
        injected = time.monotonic()

        # A non-streaming victim: its request id is the run's, found in the
        # in-flight set once admitted (the only one there then).
        unary = Unary(COMPLETIONS, words("unary victim"))
        start_unary(base, model, unary)

        def admitted() -> str | None:
            members: Any = client.zrange(keys.inflight, 0, -1)
            ids = {m.decode() for m in members}
            ids -= {victim.request_id, bystander.request_id}
            return ids.pop() if len(ids) == 1 else None

        unary_rid = wait_for(admitted, 10, "the non-streaming request to be admitted")
        wait_for(lambda: client.exists(keys.output(str(unary_rid))), 10, "its output")
        inject_output_chunk(client, keys, str(unary_rid), b"[1, 2", streamer.pid)

        for s in (victim, bystander):
            s.ended.wait(30)
        unary.ended.wait(30)
        victim_end = (victim.ended_at or injected + 99) - injected
        cancelled = [
            bool(client.exists(keys.cancel(str(r)))) for r in (victim.request_id, unary_rid)
        ]
        after = [Stream(CHAT, words("after")), Stream(COMPLETIONS, words("after c"))]
        for s in after:
            start_stream(base, model, s)
        for s in after:
            s.ended.wait(30)
        logger.warning(
            "malformed output entry: victim %s (%.2f s after the injection); "
            "non-streaming victim %s; generation cancelled %s; bystander %s; after %s",
            victim.describe(),
            victim_end,
            unary.describe(),
            cancelled,
            bystander.outcome(),
            [s.outcome() for s in after],
        )
        assert victim.outcome() == "error", victim.describe()
        assert victim.error is not None and "unreadable" in victim.error["message"]
        assert victim_end < 2.0, victim_end
        assert unary.status == 500 and unary.error is not None, unary.describe()
        assert "unreadable" in unary.error["message"], unary.describe()
        assert cancelled == [True, True]
        assert bystander.outcome() == "exact", bystander.describe()
        assert [s.outcome() for s in after] == ["exact", "exact"], [s.describe() for s in after]

        # The same on a WebSocket: an error then done for that id; the socket serves on.
        ws = ChatClient(ws_url(settings))
        stack.callback(ws.close)
        ws.chat("victim", words("websocket victim"), max_tokens=1000)
        started: dict[str, Any] = {}
        while "victim" not in started:
            msg = ws.receive()
            if msg.get("type") == "started":
                started[msg["id"]] = msg["request_id"]
        ws.until(lambda: bool(ws.reply("victim").deltas), timeout=30)
        inject_output_chunk(client, keys, started["victim"], b"\xff", streamer.pid)
        ws.wait_done("victim", timeout=10)
        ws.chat("next", "still served")
        ws.wait_done("next", timeout=30)
        (ws_error,) = ws.reply("victim").errors
        logger.warning("websocket victim: %s", ws_error)
        assert "unreadable" in ws_error["error"]["message"], ws_error
        assert ws.reply("next").text() == "still served" and not ws.reply("next").errors
        assert bool(client.exists(keys.cancel(started["victim"])))

        # A key that is not a stream at all (WRONGTYPE for XREAD): the web process's
        # one reader must end only the request that follows it, here a client
        # replaying a finished stream, while another stream goes on.
        finished = after[0].request_id
        assert finished is not None
        bystander = Stream(CHAT, words("second bystander"))
        start_stream(base, model, bystander)
        assert bystander.started.wait(30), web.output()
        client.delete(keys.output(finished))
        client.set(keys.output(finished), "not a stream")
        replay = probe("GET", base + f"/v1/streams/{finished}", "replay a broken stream")
        bystander.ended.wait(30)
        logger.warning("not a stream: %s; bystander %s", replay, bystander.outcome())
        assert replay.took_s < 2.0 and "unreadable" in replay.body, replay
        assert replay.status in (200, 500), replay  # an error event, or before any
        assert bystander.outcome() == "exact", bystander.describe()
        assert web.alive() and children(web.pid) == gunicorn_workers
