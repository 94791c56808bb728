"""The browser chat page at ``/``, driven in headless Chromium (Debian's chromium and
chromium-driver, through selenium) against a real stack: redis-server, a Celery worker
(echo engine at a moderate rate, so streaming is visible), a streamer and the web.

The resume tests put a TCP relay between the browser and the web server that can cut
every connection at once (no WebSocket closing handshake: what a dying proxy or a lost
network does), and reload the page mid-answer: the answer must still complete with
exactly the echoed text, once."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.stack import Stack, full_stack, isolated_settings

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
        reason="needs Chromium and its driver (Debian: apt install chromium chromium-driver)",
    ),
]

RATE = 15.0  # echo tokens per second: a reply of LONG takes ~15 s, plenty to watch it grow
LONG = " ".join(f"word{i}" for i in range(120))
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1200,900",
)


RESUME_GRACE_S = 30.0  # a dropped answer keeps generating this long: ample to resume
# Multi-byte characters too: a resume must not split or repeat one.
ANSWER = "Resume me: " + " ".join(f"w{i} 🦊 東京" for i in range(20)) + " end."


@pytest.fixture(scope="module")
def page_stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of its own whose echo engine runs at RATE, serving the page."""
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=RATE,
        web_workers=1,
        web_threads=8,
        resume_grace_s=RESUME_GRACE_S,
    )
    with full_stack(settings, tmp_path_factory.mktemp("page-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def page_url(page_stack: Stack) -> str:
    return page_stack.base_url + "/"


class CuttableRelay:
    """A TCP relay to the web server; ``cut()`` ends every connection through it at
    once, from both sides, while new connections still pass."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/"
        self.accepted = 0
        self.refusing = threading.Event()  # set: new connections are closed at once
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self.refusing.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._open += [client, server]
                self.accepted += 1
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> int:
        """Shut every open connection down (both ends see the TCP connection end with
        no WebSocket close frame); how many sockets were cut."""
        with self._lock:
            cut, self._open = self._open, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        return len(cut)

    def close(self) -> None:
        self.listener.close()
        self.cut()


@pytest.fixture
def relay(page_stack: Stack) -> Iterator[CuttableRelay]:
    settings = page_stack.settings
    proxy = CuttableRelay(settings.host, settings.port)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'profile'}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


class ChatPage:
    """The page as a user sees it, read through the DOM."""

    def __init__(self, driver: Any, url: str) -> None:
        self.driver = driver
        driver.get(url)
        self.wait_for(lambda: self.js("return $('connection').dataset.state") == "open")

    def js(self, script: str, *args: Any) -> Any:
        prelude = "const $ = (id) => document.getElementById(id);"
        return self.driver.execute_script(prelude + script, *args)

    def wait_for(self, cond: Any, timeout: float = 20, what: str = "the page") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = cond()
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def element(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def set_field(self, element_id: str, value: str) -> None:
        field = self.element(f"#{element_id}")
        field.clear()
        field.send_keys(value)

    def say(self, text: str) -> None:
        if any(ord(c) > 0xFFFF for c in text):  # ChromeDriver cannot type these (emoji)
            self.js("$('prompt').value = arguments[0]", text)
        else:
            self.set_field("prompt", text)
        self.element("#send").click()

    def assistant(self) -> dict[str, Any]:
        """The last assistant turn: its text, state, finish reason and label."""
        result: dict[str, Any] = self.js(
            """
            const turns = document.querySelectorAll('.message.assistant');
            const el = turns[turns.length - 1];
            if (!el) return {text: null, state: null, finish: null, label: null, count: 0};
            return {
              text: el.querySelector('.content').textContent,
              state: el.dataset.state || null,
              finish: el.dataset.finish || null,
              label: el.querySelector('.finish').textContent,
              count: turns.length,
            };
            """
        )
        return result

    def error(self) -> str | None:
        shown: str | None = self.js("return $('error').hidden ? null : $('error').textContent")
        return shown

    def button_enabled(self, element_id: str) -> bool:
        return bool(self.js("return !$(arguments[0]).disabled", element_id))

    def record_sent_messages(self) -> None:
        """Keep a copy of every message the page sends on its WebSocket."""
        self.js(
            """
            window.sent = [];
            const send = WebSocket.prototype.send;
            WebSocket.prototype.send = function (data) {
              window.sent.push(JSON.parse(data));
              return send.call(this, data);
            };
            """
        )

    def sent(self) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = self.js("return window.sent")
        return sent


def test_text_streams_in_and_stop_ends_it(browser: Any, page_url: str) -> None:
    page = ChatPage(browser, page_url)
    assert browser.title == "tokenrelay chat"
    page.say(LONG)

    first = page.wait_for(lambda: page.assistant()["text"], what="streamed text")
    assert page.assistant()["state"] == "streaming"
    assert page.button_enabled("stop") and not page.button_enabled("send")
    time.sleep(0.6)
    growing = page.assistant()["text"]
    assert len(growing) > len(first), "the reply should grow while it streams"
    assert LONG.startswith(growing)

    page.element("#stop").click()
    page.wait_for(lambda: page.assistant()["state"] == "aborted", what="the stop to land")
    stopped = page.assistant()
    assert stopped["finish"] == "abort"
    assert "stopped" in stopped["label"]
    assert LONG.startswith(stopped["text"]) and len(stopped["text"]) < len(LONG)
    time.sleep(0.6)
    assert page.assistant()["text"] == stopped["text"], "nothing may arrive after the stop"
    assert page.button_enabled("send") and not page.button_enabled("stop")
    assert page.error() is None


def test_a_conversation_keeps_its_history(browser: Any, page_url: str) -> None:
    page = ChatPage(browser, page_url)
    page.record_sent_messages()
    page.say("hello there")
    page.wait_for(lambda: page.assistant()["state"] == "done", what="the first reply")
    assert page.assistant()["text"] == "hello there"

    page.set_field("max-tokens", "3")
    page.set_field("temperature", "0.2")
    page.say("second turn with more words")
    page.wait_for(lambda: page.assistant()["count"] == 2, what="a second reply")
    page.wait_for(lambda: page.assistant()["state"] == "done", what="the second reply")
    reply = page.assistant()
    assert reply["finish"] == "length"
    assert "max tokens" in reply["label"]
    assert "second turn with more words".startswith(reply["text"])

    chats = [m for m in page.sent() if m["type"] == "chat"]
    assert len(chats) == 2
    assert chats[1]["messages"] == [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "second turn with more words"},
    ]
    assert chats[1]["max_tokens"] == 3 and chats[1]["temperature"] == 0.2


def test_a_bad_request_shows_the_error(browser: Any, page_url: str) -> None:
    page = ChatPage(browser, page_url)
    page.set_field("temperature", "5")
    page.say("hi")
    shown = page.wait_for(page.error, what="the error")
    assert "temperature" in shown
    page.wait_for(lambda: page.assistant()["state"] == "error", what="the failed turn")
    assert page.button_enabled("send")

    # The page stays usable: fix the control and ask again.
    page.set_field("temperature", "0.7")
    page.say("again")
    page.wait_for(lambda: page.assistant()["state"] == "done", what="the retried reply")
    assert page.assistant()["text"] == "again"
    assert page.error() is None


def wait_mid_answer(page: ChatPage, expected: str) -> str:
    """Wait until part (not all) of ``expected`` is shown; that part."""
    shown: str = page.wait_for(
        lambda: len(page.assistant()["text"] or "") >= 15 and page.assistant()["text"],
        what="the answer to start",
    )
    assert expected.startswith(shown) and shown != expected, shown
    return shown


def assert_done_exactly(page: ChatPage, expected: str, *, turns: int) -> None:
    page.wait_for(lambda: page.assistant()["state"] == "done", timeout=60, what="the answer")
    final = page.assistant()
    assert final["text"] == expected, "the answer must complete exactly once"
    assert final["finish"] == "stop" and final["count"] == turns
    assert page.error() is None
    time.sleep(0.5)
    assert page.assistant()["text"] == expected, "nothing may arrive after done"
    assert page.button_enabled("send") and not page.button_enabled("stop")


@pytest.mark.parametrize("how", ["connection_cut", "socket_closed"])
def test_a_dropped_socket_resumes_the_answer(browser: Any, relay: CuttableRelay, how: str) -> None:
    page = ChatPage(browser, relay.url)
    page.record_sent_messages()
    page.js(
        """
        window.sockets = [];
        const open = WebSocket.prototype.send;
        WebSocket.prototype.send = function (data) {
          if (!window.sockets.includes(this)) window.sockets.push(this);
          return open.call(this, data);
        };
        """
    )
    page.say(ANSWER)
    before = wait_mid_answer(page, ANSWER)
    if how == "connection_cut":
        assert relay.cut() >= 2
    else:  # the page's own socket object closes (as a browser extension or a bug might)
        page.js("window.sockets[0].close()")
    page.wait_for(
        lambda: (
            page.js("return $('connection').dataset.state") != "open"
            or any(m["type"] == "resume" for m in page.sent())
        ),
        what="the page to notice the drop",
    )

    assert_done_exactly(page, ANSWER, turns=1)
    (chat,) = [m for m in page.sent() if m["type"] == "chat"]
    resumes = [m for m in page.sent() if m["type"] == "resume"]
    assert resumes and all(r["id"] == chat["id"] and r["cursor"] for r in resumes), resumes
    assert page.js("return window.sockets.length") >= 2, "the page should use a new socket"
    assert len(before) < len(ANSWER)


def test_a_reload_mid_answer_keeps_the_conversation_and_resumes(
    browser: Any, page_url: str
) -> None:
    page = ChatPage(browser, page_url)
    page.say("hello there")
    page.wait_for(lambda: page.assistant()["state"] == "done", what="the first reply")
    page.say(ANSWER)
    before = wait_mid_answer(page, ANSWER)

    browser.refresh()
    restored = page.wait_for(
        lambda: page.js("return document.readyState") == "complete" and page.assistant(),
        what="the page to come back",
    )
    # The conversation so far is on screen again, the partial answer included.
    users = page.js(
        "return [...document.querySelectorAll('.message.user .content')].map(e => e.textContent)"
    )
    assert users == ["hello there", ANSWER]
    assert restored["count"] == 2
    assert ANSWER.startswith(restored["text"]) and len(restored["text"]) >= len(before)

    assert_done_exactly(page, ANSWER, turns=2)
    first = page.js("return document.querySelector('.message.assistant .content').textContent")
    assert first == "hello there"

    # The next request carries the whole conversation, from before the reload too.
    page.record_sent_messages()
    page.set_field("max-tokens", "2")
    page.say("third")
    page.wait_for(lambda: page.assistant()["count"] == 3, what="a third turn")
    page.wait_for(lambda: page.assistant()["state"] == "done", what="the third reply")
    (chat,) = [m for m in page.sent() if m["type"] == "chat"]
    assert chat["messages"] == [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": ANSWER},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "third"},
    ]


def test_stop_while_disconnected_cancels_after_the_resume(
    browser: Any, relay: CuttableRelay
) -> None:
    page = ChatPage(browser, relay.url)
    page.record_sent_messages()
    page.say(ANSWER)
    wait_mid_answer(page, ANSWER)
    relay.refusing.set()  # the server stays out of reach for a while
    relay.cut()
    page.wait_for(
        lambda: page.js("return $('connection').dataset.state") != "open",
        what="the page to notice the drop",
    )
    assert page.button_enabled("stop")
    page.element("#stop").click()
    time.sleep(0.5)
    assert page.assistant()["state"] == "streaming", "the stop cannot land while offline"
    relay.refusing.clear()

    page.wait_for(lambda: page.assistant()["state"] == "aborted", what="the stop to land")
    stopped = page.assistant()
    assert stopped["finish"] == "abort"
    assert ANSWER.startswith(stopped["text"]) and len(stopped["text"]) < len(ANSWER)
    assert [m["type"] for m in page.sent()] == ["chat", "resume", "cancel"]
    assert page.error() is None
