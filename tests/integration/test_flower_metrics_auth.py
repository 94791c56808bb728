"""Issue 16 item 14: Flower's ``/metrics`` was served without the basic auth its UI and
API ask for. Flower started as ``tokenrelay up`` and compose start it (``celery -A
broker.flower_app flower``, password in ``FLOWER_BASIC_AUTH``) now answers 401 there
without the credentials, and the metrics with them."""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from app.settings import Settings
from broker.server import free_port
from tests.stack import flower_process, wait_for

pytestmark = pytest.mark.integration


def _status(url: str, auth: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_flower_metrics_need_the_basic_auth(settings: Settings, tmp_path: Path) -> None:
    port, auth = free_port(), "ops:secret"
    flower = flower_process(settings, tmp_path, port, auth)
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return _status(f"{base}/healthcheck")[0] == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        wait_for(up, 30, "flower to answer", interval=0.3)
        assert _status(f"{base}/api/workers")[0] == 401  # as Flower's own API
        assert _status(f"{base}/metrics")[0] == 401
        assert _status(f"{base}/metrics", "ops:wrong")[0] == 401
        status, body = _status(f"{base}/metrics", auth)
        assert status == 200 and b"flower_" in body
    finally:
        flower.stop()
