"""Run ``tokenrelay up`` (directly or through ``make run``) from a test, and check what it
recorded in ``<run-dir>/up.json``: the children's PIDs, the URLs and its exit status.

Clean-up goes only through PIDs: the process the test started, then (as a safety net
when a test failed half-way) the PIDs ``up`` recorded for its children.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from broker.server import free_port
from tests.stack import REPO, wait_for

MODEL = "SmolLM2-135M-Instruct"
TIME_WAIT = "06"  # the state column of /proc/net/tcp


def up_env(**extra: str) -> dict[str, str]:
    """This environment without TOKENRELAY_* (a developer's settings must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie awaiting its reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class UpRun:
    """A supervisor process started by a test, with its output in a file."""

    def __init__(self, args: list[str], env: dict[str, str], run_dir: Path, out: Path) -> None:
        self.run_dir = run_dir
        self.out = out
        with out.open("wb") as fh:
            self.popen = subprocess.Popen(
                args,
                env=env,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def logs(self) -> str:
        """The tail of every child's log: what a failing test should show."""
        parts = [f"--- supervisor output ---\n{self.output()[-3000:]}"]
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def state(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.run_dir / "up.json").read_text())
        except (OSError, ValueError):
            return {}
        return data

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Wait until ``up`` printed its URLs; fail with every log if it exits first."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state.get("state") == "running" and "Press Ctrl-C" in self.output():
                return state
            if self.popen.poll() is not None:
                raise AssertionError(f"up exited ({self.popen.returncode}):\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"up not ready after {timeout}s:\n{self.logs()}")
            time.sleep(0.3)

    def recorded_pids(self) -> dict[str, int]:
        """The supervisor's own PID and its children's, as recorded in up.json."""
        state = self.state()
        pids = {name: int(child["pid"]) for name, child in state.get("children", {}).items()}
        if "pid" in state:
            pids["up"] = int(state["pid"])
        return pids

    def flower_auth(self) -> str:
        match = re.search(r"Flower\s+http://([^@\s]+)@", self.output())
        assert match, self.output()
        return match.group(1)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"up did not exit within {timeout}s:\n{self.logs()}") from exc

    def cleanup(self) -> None:
        """Stop whatever is left after a failed test, by the PIDs we know."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        for pid in self.recorded_pids().values():
            if pid_alive(pid):  # children lead their own groups; `up` under make does not
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def start_up(tmp_path: Path, models_dir: Path, *extra: str, **env: str) -> UpRun:
    """``tokenrelay up --engine echo`` in ``tmp_path/run`` (output in ``tmp_path/up.out``),
    on free ports unless ``extra`` names them; ``env`` adds TOKENRELAY_* variables."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "workers.up", "--engine", "echo", "--run-dir", str(run_dir)]
    for option in ("--port", "--flower-port", "--redis-port"):
        if option not in extra and not (option == "--redis-port" and "TOKENRELAY_REDIS_URL" in env):
            args += [option, str(free_port())]
    env_ = up_env(TOKENRELAY_MODELS_DIR=str(models_dir), **env)
    return UpRun([*args, *extra], env_, run_dir, tmp_path / "up.out")


def get(url: str, auth: str | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET, with basic auth ``user:password`` when given; status 0
    when nothing answers (e.g. while a server restarts)."""
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc).encode()


def upload_file(api: str, content: bytes) -> str:
    """``POST /v1/files`` (multipart, purpose ``batch``); the new file's id."""
    body = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
        + content
        + b"\r\n--b--\r\n"
    )
    request = urllib.request.Request(
        api + "/files", data=body, headers={"Content-Type": "multipart/form-data; boundary=b"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return str(json.loads(resp.read())["id"])


def listed_files(api: str) -> list[str]:
    """The ids ``GET /v1/files`` lists."""
    status, body = get(api + "/files")
    assert status == 200, body
    return [f["id"] for f in json.loads(body)["data"]]


def in_time_wait(port: int) -> int:
    """How many IPv4 sockets with local port ``port`` are in TIME_WAIT (Linux)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == TIME_WAIT)


def leave_time_wait(port: int = 0) -> int:
    """Make sure a loopback port (``port``, or a free one) has a socket in TIME_WAIT, as a
    server that closed a client's connection first and then stopped leaves behind; returns
    the port. Whether a server or its client closes first is a race, so a test that needs
    this state makes it: listen, accept, close the accepted side first.

    The listener sets SO_REUSEADDR as gunicorn, Tornado and redis-server do: a TIME_WAIT
    socket keeps its listener's flag, and Linux lets a new bind reuse the port only when
    both sockets carry it.
    """
    if port and in_time_wait(port):
        return port
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        port = int(listener.getsockname()[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server side closes first: its end of the connection ...
            assert client.recv(1) == b""
        # ... enters TIME_WAIT when the client's FIN arrives
    wait_for(lambda: in_time_wait(port), 2, "the server's socket to enter TIME_WAIT")
    return port
