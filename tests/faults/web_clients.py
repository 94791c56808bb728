"""Real HTTP clients for the web tier's fault suites: SSE streams and non-streaming calls
on both generation routes, and timed probes of any route. Each records what a user of
the API would see (status, Retry-After, text, error events, ``[DONE]``) and when, so a
test can tell an exact answer from a clear error, a 500 or a hang."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import urllib.error
import urllib.request
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


def chat_status(
    base_url: str, model: str, content: str, timeout: float = 10
) -> tuple[str, str | None]:
    """A non-streaming request: its HTTP status (or the exception's name), and its text
    when it succeeded."""
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    try:
        resp = requests.post(base_url + CHAT, json=body, timeout=timeout)
    except requests.RequestException as exc:
        return type(exc).__name__, None
    if resp.status_code != 200:
        retry_after = resp.headers.get("Retry-After")
        hint = f" (Retry-After {retry_after})" if retry_after else ""
        return f"{resp.status_code}{hint}", None
    text: str = resp.json()["choices"][0]["message"]["content"]
    return "200", text


def chat_once(base_url: str, model: str, content: str, timeout: float = 10) -> str | None:
    """A non-streaming request; its text, or None when it did not succeed."""
    return chat_status(base_url, model, content, timeout)[1]


@dataclass
class Failover:
    """What clients saw of a Redis master killed at ``killed`` (monotonic) while
    ``streams`` ran: ``watch`` times the promotion (in a thread), ``probe`` sends new
    requests until one gets its exact text, ``finish`` waits for the streams. The
    Sentinel and Redis Cluster fault tests share it."""

    killed: float
    streams: list[Stream]
    promoted: list[float] = field(default_factory=list)  # seconds after the kill
    first_ok: float | None = None  # the first new request with its exact text
    attempts: list[str] = field(default_factory=list)  # "when: status in how long"
    outcomes: list[str] = field(default_factory=list)
    _watcher: threading.Thread | None = None

    @staticmethod
    def start(base_url: str, model: str, streams: list[Stream], report: Any) -> None:
        """Read ``streams`` in threads; return once each has its first text and none
        has ended (they are mid-stream: the moment to kill a master)."""
        for s in streams:
            threading.Thread(target=read_stream, args=(base_url, model, s), daemon=True).start()
        for s in streams:
            assert s.started.wait(30), f"a stream got no text before the kill\n{report()}"
        assert all(not s.ended.is_set() for s in streams), "streams too short to be mid-stream"

    def watch(self, wait_promoted: Any) -> None:
        def run() -> None:
            wait_promoted()
            self.promoted.append(time.monotonic() - self.killed)

        self._watcher = threading.Thread(target=run, daemon=True)
        self._watcher.start()

    def probe(self, base_url: str, model: str, within_s: float) -> None:
        probe = "a new request after the failover"
        while time.monotonic() - self.killed < within_s:
            sent = time.monotonic()
            status, text = chat_status(base_url, model, probe)
            took = time.monotonic() - sent
            self.attempts.append(f"{sent - self.killed:.1f}s: {status} in {took:.1f}s")
            if text == probe:
                self.first_ok = time.monotonic() - self.killed
                return
            time.sleep(0.5)

    def finish(self, within_s: float) -> dict[str, int]:
        """Wait for the promotion and, up to ``within_s`` after the kill, the streams;
        each stream's outcome counted."""
        if self._watcher is not None:
            self._watcher.join(30)
        end_by = self.killed + within_s
        for s in self.streams:
            s.ended.wait(max(0.0, end_by - time.monotonic()))
        self.outcomes = [s.outcome() for s in self.streams]
        return {k: self.outcomes.count(k) for k in ("exact", "error", "hung", "wrong", "broken")}

    def refused_badly(self) -> list[str]:
        """New requests answered neither 503 nor 200 (a 500, a hang) while there was no
        master."""
        return [a for a in self.attempts if not (": 503 " in a or ": 200 " in a)]

    def details(self) -> str:
        return "\n".join(s.describe() for s in self.streams)

    def line(self, summary: dict[str, int]) -> str:
        """The figures of the log line each test writes."""
        first = f"{self.first_ok:.1f}" if self.first_ok is not None else "never"
        last = max((s.ended_at or time.monotonic()) - self.killed for s in self.streams)
        return (
            f"promoted {self.promoted[0]:.1f} s after the kill; first new request ok at "
            f"{first} s; streams {summary}, the last ended {last:.1f} s after the kill; new "
            f"requests: {'; '.join(self.attempts)}"
        )

    def check(self, summary: dict[str, int], procs: dict[str, Any], report: str) -> None:
        """No process died, a new request succeeded, none was answered but 503 or 200
        meanwhile (a 500, a hang), every stream exact or a clear error (none hung)."""
        details = self.details()
        dead = [n for n, p in procs.items() if not p.alive()]
        assert not dead, f"{dead} died\n{details}\n{report}"
        assert self.first_ok is not None, f"no new request succeeded\n{details}\n{report}"
        assert not self.refused_badly(), f"{self.attempts}\n{report}"
        assert summary["hung"] == 0, f"{details}\n{report}"
        assert summary["wrong"] == summary["broken"] == 0, f"{details}\n{report}"


def flower_workers(port: int, auth: str) -> dict[str, Any]:
    """Flower's workers (its API, basic auth), {} while it cannot say."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/workers?refresh=1",
        headers={"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            workers: dict[str, Any] = json.loads(resp.read())
            return workers
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return {}
