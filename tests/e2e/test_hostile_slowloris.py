"""Issue 16 line 2 ("slowloris takes the web tier down without a key"), replayed against
``tokenrelay web`` under gunicorn on a real stack (redis-server, an echo worker, a
streamer): 1,000 connections each send ``GET /health HTTP/1.1`` and ``Host: x``, then
one more header line every 2 s and never the blank line. The web tier has 2 x 8 threads
here, so before the fix the first 16 such sockets took every thread.

Now: while all 1,000 are open, other clients' ``/health``, chats and streamed chats are
each answered within 1 s; the slow ones get 408 when ``web_header_timeout_s`` is up and
are closed. Slow bodies (small ones read in the event loop, large ones by a thread) and
a kept-alive connection whose next request is slow get the same treatment.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slow_clients import Slowloris, response_of, status_of
from tests.slow_clients import normal_clients as clients_round
from tests.stack import Stack, full_stack, isolated_settings

pytestmark = pytest.mark.e2e

SLOW = 1000
HEADER_TIMEOUT_S = 8.0
BODY_TIMEOUT_S = 2.0
THREADS = 8


@pytest.fixture(scope="module")
def stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        web_workers=2,
        web_threads=THREADS,
        web_header_timeout_s=HEADER_TIMEOUT_S,
        web_body_timeout_s=BODY_TIMEOUT_S,
    )
    with full_stack(settings, tmp_path_factory.mktemp("slowloris")) as running:
        yield running


def address(stack: Stack) -> tuple[str, int]:
    return stack.settings.host, stack.settings.port


def normal_clients(stack: Stack) -> list[tuple[str, float]]:
    return clients_round(stack.base_url, stack.settings.served_model_name)


def test_2_a_thousand_slowloris_connections_do_not_keep_others_waiting(stack: Stack) -> None:
    loris = Slowloris(address(stack), SLOW)
    slow = loris.sockets
    try:
        opened = time.monotonic()
        timings: list[tuple[str, float]] = []
        # Keep the slow ones alive (one header line every 2 s) while others are served.
        while time.monotonic() - opened < HEADER_TIMEOUT_S - 3:
            assert loris.feed() == 0, "the server closed slow sockets before their timeout"
            timings += normal_clients(stack)
            time.sleep(max(0.0, 2.0 - (time.monotonic() - opened) % 2.0))
        assert len(timings) >= 6
        too_slow = [(name, round(s, 2)) for name, s in timings if s >= 1.0]
        assert not too_slow, f"served too slowly with {SLOW} slow sockets open: {too_slow}"

        # The slow ones never finished their heads: 408, then closed.
        statuses = [status_of(response_of(sock, HEADER_TIMEOUT_S + 5)) for sock in slow[:50]]
        assert statuses == [408] * 50
        assert all(status_of(response_of(sock, 5)) == 408 for sock in slow[50:])
    finally:
        loris.close()


def test_2_a_408_says_why_in_the_openai_shape(stack: Stack) -> None:
    with socket.create_connection(address(stack), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        response = response_of(sock, HEADER_TIMEOUT_S + 5)
        waited = time.monotonic() - started
    assert status_of(response) == 408
    assert HEADER_TIMEOUT_S - 1.5 < waited < HEADER_TIMEOUT_S + 2.5
    head, body = response.split(b"\r\n\r\n", 1)
    assert b"Connection: close" in head
    assert json.loads(body) == {
        "error": {
            "message": "The request did not arrive in time.",
            "type": "timeout_error",
            "param": None,
            "code": "request_timeout",
        }
    }


def test_2_clients_that_never_close_their_side_keep_no_worker_still(stack: Stack) -> None:
    """A response with ``Connection: close`` ends with the server's FIN; a client that
    then never closes its side costs a socket lingering in the worker's event loop, not
    the loop (gunicorn 27 drained each such socket on the loop's own thread, 2 s apiece:
    twenty such clients in a row kept both workers from anyone else for 20 s)."""
    held: list[socket.socket] = []
    try:
        started = time.monotonic()
        for _ in range(20):
            sock = socket.create_connection(address(stack), timeout=10)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert status_of(response_of(sock, 5)) == 200  # read to the server's FIN
            held.append(sock)  # and never closed on this side
        took = time.monotonic() - started
        timings = normal_clients(stack)
    finally:
        for sock in held:
            sock.close()
    assert took < 4.0, f"20 requests on new connections took {took:.1f} s"
    assert all(s < 1.0 for _, s in timings), timings


def chat_head(length: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % length
    )


@pytest.mark.parametrize("size", [200, 2 * 1024 * 1024], ids=["small body", "large body"])
def test_2_a_body_that_stalls_gets_408_and_holds_no_thread_meanwhile(
    stack: Stack, size: int
) -> None:
    # More stalled bodies than the web tier has threads (2 x 8).
    stalled = [socket.create_connection(address(stack), timeout=10) for _ in range(3 * THREADS)]
    try:
        for sock in stalled:
            sock.sendall(chat_head(size) + b'{"model": "' + b"x" * 60)
        if size <= 1024 * 1024:  # read in the event loop: others are served meanwhile
            timings = normal_clients(stack)
            assert all(s < 1.0 for _, s in timings), timings
        responses = [response_of(sock, BODY_TIMEOUT_S + 10) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    assert [status_of(r) for r in responses] == [408] * len(stalled)
    assert all(
        b'"code": "request_timeout"' in r or b'"code":"request_timeout"' in r for r in responses
    ), responses[0]
    assert all(s < 1.0 for _, s in normal_clients(stack))


def test_2_a_kept_alive_connection_whose_next_request_is_slow_holds_no_thread(
    stack: Stack,
) -> None:
    kept: list[socket.socket] = []
    try:
        for _ in range(3 * THREADS):
            sock = socket.create_connection(address(stack), timeout=10)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            while b"\r\n\r\n" not in first:
                first += sock.recv(4096)
            assert status_of(first) == 200
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next one, half sent
            kept.append(sock)
        timings = normal_clients(stack)
        assert all(s < 1.0 for _, s in timings), timings
    finally:
        for sock in kept:
            sock.close()
