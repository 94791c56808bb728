"""Issue 16 line 9 ("the WebSocket does not check Origin"), the decision itself:
``web.ws.origin_allowed`` over the origins browsers send. The socket-level refusal
(error message, then close 1008) is ``tests/e2e/test_hostile_limits.py``."""

from __future__ import annotations

import pytest

from web.ws import origin_allowed


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        (None, "127.0.0.1:8000"),  # a non-browser client: no Origin at all
        ("http://127.0.0.1:8000", "127.0.0.1:8000"),
        ("HTTP://LocalHost:8000", "localhost:8000"),
        ("https://chat.example.com", "chat.example.com"),  # default port both sides
        ("https://chat.example.com:443", "chat.example.com"),
        ("http://[::1]:8000", "[::1]:8000"),
    ],
)
def test_same_origin_and_no_origin_are_allowed(origin: str | None, host: str) -> None:
    assert origin_allowed(origin, host, [])


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        ("http://evil.example", "127.0.0.1:8000"),  # the drive-by page
        ("http://127.0.0.1:8001", "127.0.0.1:8000"),  # another port is another origin
        ("https://127.0.0.1", "127.0.0.1:8000"),  # https's default port is 443
        ("null", "127.0.0.1:8000"),  # sandboxed frames and file:// pages
        ("not a url", "127.0.0.1:8000"),
        ("http://127.0.0.1:8000", None),
        ("http://127.0.0.1:8000", "127.0.0.1:bad"),
    ],
)
def test_other_origins_are_refused_by_default(origin: str, host: str | None) -> None:
    assert not origin_allowed(origin, host, [])


def test_the_allowlist_adds_exact_origins_or_any() -> None:
    allowed = ["https://chat.example.com", "http://localhost:3000/"]
    assert origin_allowed("https://chat.example.com", "api.internal:8000", allowed)
    assert origin_allowed("https://chat.example.com:443", "api.internal:8000", allowed)
    assert origin_allowed("http://localhost:3000", "api.internal:8000", allowed)
    assert not origin_allowed("http://chat.example.com", "api.internal:8000", allowed)
    assert not origin_allowed("https://evil.example", "api.internal:8000", allowed)
    assert origin_allowed("https://evil.example", "api.internal:8000", ["*"])
