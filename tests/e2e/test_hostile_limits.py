"""Issue 16 ("hostile clients"), the limits on one client's share, through real
processes: redis-server, an echo worker, a streamer and ``tokenrelay web`` under
gunicorn, with two keys as the issue probed them. Each test replays a numbered line of
the issue and checks the exact answer a client gets now.

(Tenancy, file quotas and input limits are ``tests/e2e/test_hostile_clients.py``.)
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import websocket

from broker.keys import Keys
from broker.requests import RequestStore
from tests.stack import (
    Stack,
    close_client,
    full_stack,
    isolated_settings,
    wait_for,
    web_process,
    web_settings,
)

pytestmark = pytest.mark.e2e

ALPHA, BETA = "k-alpha", "k-beta"
EVIL = "http://evil.example"
QUOTA = 4  # key_max_in_flight
RATE = 200.0  # echo steps per second (every choice advances one token per step)
LONG = " ".join(f"word{i}" for i in range(600))  # 2,290 tokens: 11 s at RATE
HUGE = " ".join(f"word{i}" for i in range(1500))  # 6,390 tokens: 32 s at RATE
STALL_S = 2.0


@pytest.fixture(scope="module")
def stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        api_keys=[ALPHA, BETA],
        echo_tokens_per_second=RATE,
        key_max_in_flight=QUOTA,
        stream_buffer_bytes=64 * 1024,
        stream_stall_s=STALL_S,
        web_workers=1,
        web_threads=16,
    )
    with full_stack(settings, tmp_path_factory.mktemp("hostile-limits")) as running:
        yield running


def ws_url(base_url: str, key: str = ALPHA) -> str:
    return base_url.replace("http://", "ws://", 1) + f"/v1/ws?api_key={key}"


def hang_up(ws: websocket.WebSocket) -> None:
    """Close and release the socket (``close`` alone keeps it once the server closed)."""
    ws.close()
    ws.shutdown()


def ping_ok(ws: websocket.WebSocket) -> bool:
    ws.send(json.dumps({"type": "ping", "id": "p"}))
    return bool(json.loads(ws.recv()) == {"type": "pong", "id": "p"})


def refused_with_1008(ws: websocket.WebSocket) -> dict[str, object]:
    """The error message a refused socket gets, after checking the close that follows."""
    msg: dict[str, object] = json.loads(ws.recv())
    opcode, frame = ws.recv_data_frame(control_frame=True)
    assert opcode == websocket.ABNF.OPCODE_CLOSE
    assert int.from_bytes(frame.data[:2], "big") == 1008
    return msg


# -- 9: the WebSocket checks Origin ---------------------------------------------------------


def test_9_a_page_from_another_origin_cannot_open_the_websocket(stack: Stack) -> None:
    ws = websocket.create_connection(ws_url(stack.base_url), timeout=10, origin=EVIL)
    try:
        msg = refused_with_1008(ws)
    finally:
        hang_up(ws)
    assert msg == {
        "type": "error",
        "error": {
            "message": f"WebSocket connections from origin '{EVIL}' are not allowed; add it "
            "to TOKENRELAY_WS_ALLOWED_ORIGINS to allow it.",
            "type": "permission_error",
            "param": None,
            "code": "origin_not_allowed",
        },
    }


@pytest.mark.parametrize("how", ["same origin", "no origin"])
def test_9_same_origin_pages_and_non_browser_clients_are_served(stack: Stack, how: str) -> None:
    # websocket-client sends Origin http://<host>:<port> (this server's) unless suppressed.
    ws = websocket.create_connection(
        ws_url(stack.base_url), timeout=10, suppress_origin=how == "no origin"
    )
    try:
        assert ping_ok(ws)
    finally:
        hang_up(ws)


def test_9_extra_origins_come_from_a_setting(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = web_settings(stack.settings, ws_allowed_origins=[EVIL])
    with web_process(other, tmp_path_factory.mktemp("origins")):
        base = f"http://{other.host}:{other.port}"
        ws = websocket.create_connection(ws_url(base), timeout=10, origin=EVIL)
        try:
            assert ping_ok(ws)
        finally:
            hang_up(ws)
        ws = websocket.create_connection(ws_url(base), timeout=10, origin="http://other.example")
        try:
            assert refused_with_1008(ws)["error"]["code"] == "origin_not_allowed"  # type: ignore[index]
        finally:
            hang_up(ws)


# -- 4: one key cannot take every slot ---------------------------------------------------


def test_4_many_chats_on_one_websocket_hit_the_key_quota_not_other_keys(stack: Stack) -> None:
    ws = websocket.create_connection(ws_url(stack.base_url, ALPHA), timeout=15)
    try:
        for i in range(QUOTA + 3):
            ws.send(
                json.dumps(
                    {"type": "chat", "id": f"c{i}", "messages": [{"role": "user", "content": LONG}]}
                )
            )
        started, refused = set(), {}
        while len(started) + len(refused) < QUOTA + 3:
            msg = json.loads(ws.recv())
            if msg["type"] == "started":
                started.add(msg["id"])
            elif msg["type"] == "error":
                refused[msg["id"]] = msg["error"]
        assert len(started) == QUOTA and len(refused) == 3
        assert all(
            e
            == {
                "message": f"This API key already has {QUOTA} requests in flight, its quota "
                "(key_max_in_flight); retry when one has finished.",
                "type": "rate_limit_error",
                "param": None,
                "code": "quota_exceeded",
            }
            for e in refused.values()
        )
        over = requests.post(  # alpha over HTTP: the same quota
            f"{stack.base_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {ALPHA}"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=10,
        )
        assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
        other = requests.post(  # beta is served meanwhile
            f"{stack.base_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {BETA}"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=10,
        )
        assert other.status_code == 200, other.text
        for i in started:
            ws.send(json.dumps({"type": "cancel", "id": i}))
    finally:
        hang_up(ws)


# -- 12: a client that does not read its stream -------------------------------------------


def in_flight(stack: Stack) -> int:
    client = stack.redis()
    try:
        return RequestStore(client, Keys(stack.settings.key_prefix)).in_flight(time.time())
    finally:
        close_client(client)  # ``close`` leaves the pool's connection open


def test_12_a_client_that_never_reads_its_sse_stream_is_dropped(stack: Stack) -> None:
    # Earlier tests' runs are gone first.
    wait_for(lambda: in_flight(stack) == 0, 30, "no request in flight")
    body = json.dumps(
        {"messages": [{"role": "user", "content": HUGE}], "n": 16, "stream": True}
    ).encode()
    host, port = stack.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing
    sock.connect((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            + f"Host: {host}:{port}\r\nAuthorization: Bearer {ALPHA}\r\n".encode()
            + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: in_flight(stack) == 1, 10, "the chat admitted")
        started = time.monotonic()
        # Generating the whole output takes ~32 s; the socket stays open and unread.
        wait_for(lambda: in_flight(stack) == 0, 25, "the unread chat dropped")
        dropped_after = time.monotonic() - started
    finally:
        sock.close()
    assert dropped_after < 25
    logs = stack.procs["web"].output()
    assert "took nothing for" in logs and "dropping it" in logs, logs[-3000:]
