"""Real HTTP clients for the web tier's fault suites: SSE streams and non-streaming calls
on both generation routes, and timed probes of any route. Each records what a user of
the API would see (status, Retry-After, text, error events, ``[DONE]``) and when, so a
test can tell an exact answer from a clear error, a 500 or a hang."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def words(tag: str, count: int = 40) -> str:
    """A prompt the echo engine answers with itself, ~2 tokens a word."""
    return f"{tag}: " + " ".join(f"word{j}" for j in range(count)) + " end"


def body_for(route: str, model: str, content: str, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": 1000, "stream": stream}
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = content
    return body


def text_of(route: str, choice: dict[str, Any], *, stream: bool) -> str:
    if route == COMPLETIONS:
        return str(choice.get("text") or "")
    part = choice["delta"] if stream else choice["message"]
    return str(part.get("content") or "")


@dataclass
class Stream:
    """One streamed request read to its end by ``read_stream`` in a thread."""

    route: str
    content: str
    status: int | None = None
    request_id: str | None = None  # the x-request-id header: the server's request id
    content_type: str | None = None
    text: str = ""
    error: dict[str, Any] | None = None  # an SSE error event's body
    finish: str | None = None
    done: bool = False  # data: [DONE] seen
    failure: str | None = None  # not a 200, or the connection broke
    headers_at: float | None = None  # monotonic: when the status line arrived
    ended_at: float | None = None  # monotonic
    started: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    def outcome(self) -> str:
        """``exact`` (the whole text, a finish reason, [DONE]), ``error`` (a clear error
        event, [DONE], and only a correct prefix before it), ``hung`` (not ended), or
        ``broken`` (anything else: a dropped connection, wrong text, no [DONE])."""
        if not self.ended.is_set():
            return "hung"
        if self.error is None and self.failure is None and self.finish and self.done:
            return "exact" if self.text == self.content else "wrong"
        if self.error is not None and self.done and self.content.startswith(self.text):
            return "error"
        return "broken"

    def describe(self) -> str:
        return (
            f"{self.route} {self.outcome()}: status={self.status} finish={self.finish} "
            f"error={self.error} failure={self.failure} done={self.done} "
            f"got={len(self.text)}/{len(self.content)} chars"
        )


def read_stream(base_url: str, model: str, stream: Stream, timeout: float = 90) -> None:
    """POST a streamed request and read its SSE events to ``[DONE]``."""
    body = body_for(stream.route, model, stream.content, stream=True)
    try:
        with requests.post(
            base_url + stream.route, json=body, stream=True, timeout=(5, timeout)
        ) as resp:
            stream.status = resp.status_code
            stream.request_id = resp.headers.get("x-request-id")
            stream.content_type = resp.headers.get("Content-Type")
            stream.headers_at = time.monotonic()
            if resp.status_code != 200:
                stream.failure = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return
            for raw in resp.iter_lines():
                line = raw.decode("utf-8")
                if not line.startswith("data: "):
                    continue  # keep-alive comments, event ids, blank separators
                data = line[len("data: ") :]
                if data == "[DONE]":
                    stream.done = True
                    break
                payload = json.loads(data)
                if "error" in payload:
                    stream.error = payload["error"]
                    continue
                for choice in payload["choices"]:
                    stream.text += text_of(stream.route, choice, stream=True)
                    stream.finish = choice.get("finish_reason") or stream.finish
                if stream.text:
                    stream.started.set()
    except (requests.RequestException, ValueError) as exc:
        stream.failure = f"{type(exc).__name__}: {exc}"
    finally:
        stream.ended_at = time.monotonic()
        stream.started.set()
        stream.ended.set()


def start_stream(base_url: str, model: str, stream: Stream) -> threading.Thread:
    t = threading.Thread(target=read_stream, args=(base_url, model, stream), daemon=True)
    t.start()
    return t


@dataclass
class Unary:
    """One non-streaming request, sent by ``read_unary`` in a thread."""

    route: str
    content: str
    status: int | None = None
    text: str | None = None
    error: dict[str, Any] | None = None
    failure: str | None = None
    ended_at: float | None = None
    ended: threading.Event = field(default_factory=threading.Event)

    def outcome(self) -> str:
        """``exact``, ``error`` (an OpenAI error body with a 4xx/503/504 status),
        ``hung`` or ``broken`` (a 500, a dropped connection, wrong text)."""
        if not self.ended.is_set():
            return "hung"
        if self.status == 200 and self.text is not None:
            return "exact" if self.text == self.content else "wrong"
        if self.status is not None and self.status != 500 and self.error is not None:
            return "error"
        return "broken"

    def describe(self) -> str:
        return f"{self.route} unary {self.outcome()}: status={self.status} error={self.error}"


def read_unary(base_url: str, model: str, unary: Unary, timeout: float = 90) -> None:
    body = body_for(unary.route, model, unary.content, stream=False)
    try:
        resp = requests.post(base_url + unary.route, json=body, timeout=(5, timeout))
        unary.status = resp.status_code
        payload = resp.json()
        if resp.status_code == 200:
            unary.text = text_of(unary.route, payload["choices"][0], stream=False)
        else:
            unary.error = payload.get("error")
    except (requests.RequestException, ValueError) as exc:
        unary.failure = f"{type(exc).__name__}: {exc}"
    finally:
        unary.ended_at = time.monotonic()
        unary.ended.set()


def start_unary(base_url: str, model: str, unary: Unary) -> threading.Thread:
    t = threading.Thread(target=read_unary, args=(base_url, model, unary), daemon=True)
    t.start()
    return t


@dataclass(frozen=True)
class Probe:
    """What one request got: status (or the exception's name), Retry-After, how long
    the answer took, and the first bytes of the body."""

    what: str
    status: int | str
    retry_after: str | None
    took_s: float
    body: str

    def __str__(self) -> str:
        ra = f" Retry-After={self.retry_after}" if self.retry_after else ""
        return f"{self.what}: {self.status}{ra} in {self.took_s:.2f}s {self.body[:120]!r}"


def probe(method: str, url: str, what: str, timeout: float = 10, **kwargs: Any) -> Probe:
    """One request, its answer read whole (a stream is read to its end)."""
    started = time.monotonic()
    try:
        resp = requests.request(method, url, timeout=timeout, **kwargs)
        body = resp.text
        status: int | str = resp.status_code
        retry_after = resp.headers.get("Retry-After")
    except requests.RequestException as exc:
        body, status, retry_after = str(exc), type(exc).__name__, None
    return Probe(what, status, retry_after, time.monotonic() - started, body)


def children(pid: int) -> set[int]:
    """PIDs whose parent is ``pid`` (gunicorn's workers), from /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.add(int(entry))
    return found
