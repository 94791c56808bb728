"""The browser chat page at ``/``, driven in headless Chromium (Debian's chromium and
chromium-driver, through selenium) against a real stack: redis-server, a Celery worker
(echo engine at a moderate rate, so streaming is visible), a streamer and the web."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.stack import full_stack, isolated_settings

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.integration,
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


@pytest.fixture(scope="module")
def page_url(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A stack of its own whose echo engine runs at RATE, serving the page."""
    settings = isolated_settings(
        "redis://unused", models_dir, echo_tokens_per_second=RATE, web_workers=1, web_threads=8
    )
    with full_stack(settings, tmp_path_factory.mktemp("page-logs")) as running:
        yield running.base_url + "/"


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
