"""Slow and ordinary HTTP clients for the slowloris test and benchmark (issue 16, line 2).

``Slowloris`` holds many sockets that each send a request line and a header, then one
more header line whenever ``feed`` is called, never the blank line that ends a head.
``normal_clients`` is one round of ordinary clients on new connections, timed.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable

import requests


def response_of(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    received = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        received += chunk
    return received


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP/1.1 response (0: none)."""
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


class Slowloris:
    """``count`` connections to ``address`` that never finish their request heads."""

    def __init__(self, address: tuple[str, int], count: int) -> None:
        self.sockets: list[socket.socket] = []
        self.lines = 0
        for i in range(count):
            sock = socket.create_connection(address, timeout=10)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            self.sockets.append(sock)
            if i % 100 == 99:
                time.sleep(0.05)  # let the server accept; its backlog holds the rest anyway

    def feed(self) -> int:
        """One more header line on every socket; how many the server had closed."""
        closed = 0
        for sock in self.sockets:
            try:
                sock.sendall(b"X-Slow-%d: a\r\n" % self.lines)
            except OSError:
                closed += 1
        self.lines += 1
        return closed

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def normal_clients(base_url: str, model: str, timeout: float = 5.0) -> list[tuple[str, float]]:
    """One round of ordinary clients, each on a new connection: ``/health``, a chat and a
    streamed chat, and how long each took (``inf``: it failed or timed out)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "still here"}]}

    def health() -> bool:
        return requests.get(f"{base_url}/health", timeout=timeout).status_code == 200

    def chat_once() -> bool:
        reply = requests.post(f"{base_url}/v1/chat/completions", json=chat, timeout=timeout)
        return reply.status_code == 200 and (
            reply.json()["choices"][0]["message"]["content"] == "still here"
        )

    def chat_streamed() -> bool:
        with requests.post(
            f"{base_url}/v1/chat/completions", json={**chat, "stream": True}, timeout=timeout
        ) as reply:
            return reply.status_code == 200 and b"data: [DONE]" in reply.content

    def timed(call: Callable[[], bool]) -> float:
        started = time.monotonic()
        try:
            ok = call()
        except requests.RequestException:
            ok = False
        return time.monotonic() - started if ok else math.inf

    return [
        (name, timed(call))
        for name, call in [("health", health), ("chat", chat_once), ("stream", chat_streamed)]
    ]
