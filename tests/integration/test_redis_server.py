"""The private redis-server that tests and benchmarks start: it dies with the process
that started it, so a killed test run leaves no server behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

SPAWN = """
import sys, time
from broker.server import RedisServer
server = RedisServer().start()
print(server.proc.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_redis_server_dies_with_the_process_that_started_it() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", SPAWN], cwd=REPO, stdout=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # running
        parent.kill()  # SIGKILL: no cleanup of its own runs
        parent.wait(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return  # gone (init reaped it)
            if _is_zombie(child):
                return
            time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the redis-server outlived the process that started it")


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False
