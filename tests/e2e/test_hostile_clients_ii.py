"""Issue 47 ("hostile clients II") through real processes: redis-server, an echo worker,
a streamer and ``tokenrelay web`` under gunicorn, with two ordinary keys and an admin
key. Each test replays a numbered finding of the issue, as a hostile key would, and
checks that the other key's request still succeeds within a bound and that nothing
answers 500.

Findings that need a moment no client can choose (Redis filling up between two writes)
are in ``tests/web/test_hostile_clients_ii.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket

from tests.faults.web_clients import children
from tests.stack import Stack, stack_with

pytestmark = pytest.mark.e2e

ALPHA, BETA, ADMIN = "k-alpha", "k-beta", "k-admin"
# Two ordinary keys and an admin key, on one web worker (its threads are what is counted).
TENANTS: dict[str, Any] = {
    "api_keys": [ALPHA, BETA, ADMIN],
    "admin_api_keys": [ADMIN],
    "web_workers": 1,
}
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("hostile-ii-logs")
    with stack_with(models_dir, log_dir, web_threads=32, key_max_connections=8, **TENANTS) as st:
        yield st


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(content: str = "hello there", **body: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 16, **body}


def post(stack: Stack, key: str, body: Any, path: str = CHAT, timeout: float = 30) -> Any:
    return requests.post(f"{stack.base_url}{path}", headers=auth(key), json=body, timeout=timeout)


def other_key_is_served(stack: Stack, within_s: float = 10.0) -> None:
    """Beta's plain chat succeeds, and within ``within_s``."""
    started = time.monotonic()
    resp = post(stack, BETA, chat("the other key"), timeout=within_s)
    took = time.monotonic() - started
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "the other key"
    assert took < within_s, f"the other key waited {took:.1f} s"


def streamed(stack: Stack, key: str, content: str) -> tuple[str, list[str]]:
    """A streamed chat to its end: its request id and every SSE event id it carried."""
    resp = post(stack, key, chat(content, stream=True))
    assert resp.status_code == 200, resp.text
    ids = [ln[len("id: ") :] for ln in resp.text.splitlines() if ln.startswith("id: ")]
    return resp.headers["X-Request-Id"], ids


def wide_schema(properties: int) -> dict[str, Any]:
    names = [f"field_{i}" for i in range(properties)]
    return {
        "type": "object",
        "properties": {n: {"type": "string"} for n in names},
        "required": names,
        "additionalProperties": False,
    }


def test_1_a_schema_too_costly_to_compile_is_refused_at_once(stack: Stack) -> None:
    """Finding 1: 10,000 required properties (a 378 KB schema) compiled on the worker's
    engine thread, past its lease, again on every retry; other keys' requests failed
    with it. Now: a 400 in the API's words on arrival, for each of 16 concurrent
    requests, and the other key is served meanwhile."""
    body = chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "wide", "schema": wide_schema(10_000)},
        }
    )
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        hostile = [pool.submit(post, stack, ALPHA, body) for _ in range(16)]
        other_key_is_served(stack)
        answers = [f.result() for f in hostile]
    assert time.monotonic() - started < 30
    for resp in answers:
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert "more than 5000 object properties" in error["message"]
        assert error["param"] == "response_format.json_schema.schema"


def test_8_a_cursor_past_the_end_of_a_finished_stream_answers_at_once(stack: Stack) -> None:
    """Finding 8: ``Last-Event-ID: 50/0`` on a finished 5-token stream kept the client on
    keep-alives until the request's deadline (545 s), and a WebSocket ``resume`` past
    the end got ``started``, then silence. Both end at once now."""
    rid, ids = streamed(stack, ALPHA, "five tokens of text here")
    last_chunk = max(int(i.split("/")[0]) for i in ids)
    for cursor in (f"{last_chunk + 45}/0", ids[-1]):
        started = time.monotonic()
        resp = requests.get(
            f"{stack.base_url}/v1/streams/{rid}",
            headers={**auth(ALPHA), "Last-Event-ID": cursor},
            timeout=15,
        )
        assert resp.status_code == 200
        assert resp.text.rstrip().endswith("data: [DONE]")
        assert '"content"' not in resp.text  # nothing after the end
        assert time.monotonic() - started < 5

    url = stack.base_url.replace("http://", "ws://") + "/v1/ws"
    ws = websocket.create_connection(url, timeout=10, header=[f"Authorization: Bearer {ALPHA}"])
    try:
        started = time.monotonic()
        ws.send(json.dumps({"type": "resume", "id": "r", "request_id": rid, "cursor": "999/0"}))
        kinds = []
        while not kinds or kinds[-1] != "done":
            kinds.append(json.loads(ws.recv())["type"])
        assert kinds[0] == "started" and "error" not in kinds, kinds
        assert time.monotonic() - started < 5
    finally:
        ws.close()
    other_key_is_served(stack)


def test_9_constraint_errors_carry_no_library_internals(stack: Stack) -> None:
    """Finding 9: an enum of 8,007 values passed the check on arrival and came back from
    the worker as "Current row has 8007 items; max is 2000". It is refused on arrival
    now, in plain words."""
    schema = {
        "type": "object",
        "properties": {"pick": {"enum": [f"value {i}" for i in range(8007)]}},
        "required": ["pick"],
    }
    resp = post(
        stack,
        ALPHA,
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}
        ),
    )
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "more than 1000 enum values" in message
    for internal in ("row has", "max is", "compute_time", "lexer", "NoExtensionBias"):
        assert internal not in message
    other_key_is_served(stack)


def test_10_an_admin_key_cannot_read_or_resume_another_keys_stream(stack: Stack) -> None:
    """Finding 10: admin keys read and resumed other keys' streams, which docs/security.md
    did not grant. Now a 404 (as for any key not its owner) over HTTP and the
    WebSocket; the owner still resumes it."""
    rid, _ids = streamed(stack, ALPHA, "a private conversation")
    for key in (ADMIN, BETA):
        resp = requests.get(f"{stack.base_url}/v1/streams/{rid}", headers=auth(key), timeout=10)
        assert resp.status_code == 404, (key, resp.text)
    own = requests.get(f"{stack.base_url}/v1/streams/{rid}", headers=auth(ALPHA), timeout=10)
    assert own.status_code == 200 and "a private conversation" in "".join(
        json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
        for ln in own.text.splitlines()
        if ln.startswith("data: {") and json.loads(ln[6:])["choices"]
    )
    url = stack.base_url.replace("http://", "ws://") + "/v1/ws"
    ws = websocket.create_connection(url, timeout=10, header=[f"Authorization: Bearer {ADMIN}"])
    try:
        ws.send(json.dumps({"type": "resume", "id": "r", "request_id": rid}))
        reply = json.loads(ws.recv())
        assert reply["type"] == "error" and reply["error"]["code"] == "stream_not_found"
    finally:
        ws.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"999999999": 5}),
        ("logit_bias", {str(2**64 + 1): 5}),
        ("stop_token_ids", [2**70]),
        ("stop_token_ids", [49152]),
        ("top_k", 2**40),
        ("min_tokens", 2**40),
    ],
)
def test_11_out_of_vocabulary_ids_and_absurd_integers_are_400s(
    stack: Stack, field: str, value: Any
) -> None:
    """Finding 11: token ids outside the vocabulary (49,152 ids) and integers no engine
    takes were accepted; now a 400 naming the field."""
    resp = post(stack, ALPHA, chat(**{field: value}))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field
    assert post(stack, ALPHA, chat(logit_bias={"49151": 1})).status_code == 200


def test_6_one_key_cannot_hold_every_web_thread_with_websockets(stack: Stack) -> None:
    """Finding 6: 384 idle WebSockets of one key took every web thread; other keys'
    chats timed out and ``/health`` stalled. One key now holds at most
    ``key_max_connections`` (8 here, of 32 threads); the next is refused with an error
    message naming the quota, and the other key is served at once."""
    url = stack.base_url.replace("http://", "ws://") + "/v1/ws"
    held = []
    try:
        for _ in range(8):
            held.append(
                websocket.create_connection(
                    url, timeout=10, header=[f"Authorization: Bearer {ALPHA}"]
                )
            )
        for ws in held:  # each is open and served
            ws.send(json.dumps({"type": "ping", "id": "p"}))
            assert json.loads(ws.recv()) == {"type": "pong", "id": "p"}
        extra = websocket.create_connection(
            url, timeout=10, header=[f"Authorization: Bearer {ALPHA}"]
        )
        try:
            reply = json.loads(extra.recv())
            assert reply["type"] == "error" and reply["error"]["code"] == "quota_exceeded"
            assert "key_max_connections" in reply["error"]["message"]
        finally:
            extra.close()
        started = time.monotonic()
        assert requests.get(f"{stack.base_url}/health", timeout=5).status_code == 200
        other_key_is_served(stack, within_s=5)
        beta = websocket.create_connection(
            url, timeout=10, header=[f"Authorization: Bearer {BETA}"]
        )
        beta.send(json.dumps({"type": "ping", "id": "b"}))
        assert json.loads(beta.recv()) == {"type": "pong", "id": "b"}
        beta.close()
        assert time.monotonic() - started < 5
        held.pop().close()  # a closed socket frees its place
        deadline = time.monotonic() + 5
        while True:
            again = websocket.create_connection(
                url, timeout=10, header=[f"Authorization: Bearer {ALPHA}"]
            )
            again.send(json.dumps({"type": "ping", "id": "a"}))
            reply = json.loads(again.recv())
            if reply["type"] == "pong":
                held.append(again)
                break
            again.close()
            assert time.monotonic() < deadline, reply
            time.sleep(0.1)
    finally:
        for ws in held:
            ws.close()


@pytest.fixture(scope="module")
def llama_stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The bundled model on llama.cpp with a 1,024-token KV cache (4 slots)."""
    log_dir = tmp_path_factory.mktemp("hostile-ii-llama-logs")
    small_kv = {"llamacpp_n_ctx": 1024, "worker_slots": 2}
    with stack_with(models_dir, log_dir, engine="llamacpp", **small_kv, **TENANTS) as st:
        yield st


@pytest.mark.slow
def test_2_one_request_cannot_take_the_whole_kv_cache(llama_stack: Stack) -> None:
    """Finding 2: one chat with ``n: 16, max_tokens: 2000, ignore_eos`` (inside every
    documented limit) took the whole llama.cpp KV cache, and other keys' chats failed
    with a 500 "out of KV cache memory". Such a request can only end when it has filled
    prompt + n x max_tokens cells, so one that cannot fit is a 400 at once now; the other
    key's chat, sent meanwhile, succeeds."""
    hog = chat("count to a thousand", n=4, max_tokens=400, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(post, llama_stack, ALPHA, hog, CHAT, 120)
        started = time.monotonic()
        other = post(llama_stack, BETA, chat("Say hi.", max_tokens=30), timeout=120)
        assert other.status_code == 200, other.text
        assert time.monotonic() - started < 60
        refused = hostile.result()
    assert refused.status_code == 400, refused.text
    assert "ignore_eos" in refused.json()["error"]["message"]
    fits = post(llama_stack, ALPHA, chat("Say hi.", max_tokens=50, ignore_eos=True), CHAT, 120)
    assert fits.status_code == 200
    assert fits.json()["usage"]["completion_tokens"] == 50


def rss_mb(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


@pytest.mark.slow
def test_7_replays_of_a_long_stream_are_bounded_like_live_ones(stack: Stack) -> None:
    """Finding 7: replays of a finished stream were written in single pieces of 14-51 MB;
    20 clients that never read a 28 MB replay held +830 MB of the web process. Now a
    replay is read and written in bounded pieces under the stream buffer: 7 replays of
    a ~20 MB stream that are never read (with the reader below, the key's
    ``key_max_connections``) cost the web worker under 200 MB, a reader gets it
    whole, and the other key is served meanwhile."""
    words = " ".join(["token"] * 3000)
    body = chat(words, max_tokens=3100, n=4, logprobs=True, top_logprobs=20)
    resp = post(stack, ALPHA, body, timeout=120)
    assert resp.status_code == 200, resp.text
    rid = resp.headers["X-Request-Id"]
    workers = children(stack.procs["web"].pid)
    before = rss_mb(workers)
    stalled = []
    try:
        for _ in range(7):
            r = requests.get(
                f"{stack.base_url}/v1/streams/{rid}", headers=auth(ALPHA), stream=True, timeout=30
            )
            assert r.status_code == 200
            stalled.append(r)  # its body is never read
        time.sleep(3)
        other_key_is_served(stack, within_s=5)
        # What the stalled replays hold, measured before a reader takes the whole stream.
        # Measured here: +18 to +144 MB (the before-830-MB defect would be ~290 MB for 7).
        # The spread: a reader's buffer bounds the raw bytes of its entries, and their
        # decoded events (n=4, 20 top logprobs a token) weigh several times more while
        # the stalled threads hold them (docs/security.md, "Issue 47": open).
        grown = rss_mb(workers) - before
        full = requests.get(f"{stack.base_url}/v1/streams/{rid}", headers=auth(ALPHA), timeout=60)
        assert full.status_code == 200
        size = len(full.content)
        assert full.text.rstrip().endswith("data: [DONE]") and size > 5_000_000, size
        print(f"replay of {size / 1e6:.1f} MB; 7 stalled replays: web worker +{grown:.0f} MB")
        assert grown < 200
    finally:
        for r in stalled:
            r.close()


@pytest.fixture(scope="module")
def busy_stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Workers are the bottleneck: one worker of 2 slots, 20 echo tokens a second."""
    log_dir = tmp_path_factory.mktemp("hostile-ii-busy-logs")
    busy = {"worker_slots": 2, "echo_tokens_per_second": 20.0}
    with stack_with(models_dir, log_dir, web_threads=32, **busy, **TENANTS) as st:
        yield st


@pytest.mark.slow
def test_5_one_key_cannot_hold_the_queue(busy_stack: Stack) -> None:
    """Finding 5: 128 background responses from one key (inside its in-flight quota)
    made other keys' 3-token chats wait 80 s, in arrival order. A key's requests now
    queue behind other keys' by how many it has in flight (``fair_priority``): with
    24 one-second responses of alpha queued for 2 slots (12 s in arrival order), beta's
    chat is served within a few seconds, and alpha's all finish."""
    words = " ".join(["word"] * 30)
    ids = []
    for _ in range(24):
        body = {"input": words, "max_output_tokens": 20, "background": True, "store": True}
        resp = post(busy_stack, ALPHA, body, "/v1/responses")
        assert resp.status_code == 200, resp.text
        assert resp.json()["status"] == "queued"
        ids.append(resp.json()["id"])
    time.sleep(1.0)  # alpha's queue is in place, its first two running
    started = time.monotonic()
    other = post(busy_stack, BETA, chat("quick one", max_tokens=3), timeout=60)
    took = time.monotonic() - started
    assert other.status_code == 200, other.text
    print(f"beta waited {took:.1f} s behind alpha's 24 queued responses")
    assert took < 5, f"beta waited {took:.1f} s"
    deadline = time.monotonic() + 60
    for rid in ids:
        while True:
            got = requests.get(f"{busy_stack.base_url}/v1/responses/{rid}", headers=auth(ALPHA))
            status = got.json()["status"]
            if status in ("completed", "incomplete"):
                break
            assert status in ("queued", "in_progress"), got.text
            assert time.monotonic() < deadline, "alpha's responses did not all finish"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def quota_stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Output kept for replay limited to 1 MB per key."""
    log_dir = tmp_path_factory.mktemp("hostile-ii-quota-logs")
    with stack_with(models_dir, log_dir, key_max_output_bytes=1_000_000, **TENANTS) as st:
        yield st


@pytest.mark.slow
def test_3_output_kept_for_replay_counts_against_a_per_key_quota(quota_stack: Stack) -> None:
    """Finding 3 (outputs): a key's streams are kept ``stream_ttl_s`` for resumes and
    replays, and one n=8 request left 112 MB; outputs were bounded by nothing. The
    streamers count each key's output bytes, and past ``key_max_output_bytes`` (1 MB
    here) the key's next request is a 429 naming the quota, with a Retry-After until
    its oldest output leaves the window; the other key is served."""
    body = chat(" ".join(["word"] * 1000), max_tokens=1000, logprobs=True, top_logprobs=20)
    deadline = time.monotonic() + 60
    while True:
        resp = post(quota_stack, ALPHA, body, timeout=60)
        if resp.status_code == 429:
            break
        assert resp.status_code == 200, resp.text
        assert time.monotonic() < deadline, "the output quota never applied"
        time.sleep(1.5)  # the streamers add their counts at each heartbeat
    error = resp.json()["error"]
    assert error["code"] == "quota_exceeded" and "key_max_output_bytes" in error["message"]
    assert 0 < int(resp.headers["Retry-After"]) <= 3600 + 300
    other_key_is_served(quota_stack)
