"""Children of ``tokenrelay up``: started in their own session, watched without being
reaped, stopped by the PID we started (SIGTERM, a grace period, then SIGKILL to the
process group it leads), and given SIGTERM if the supervisor itself dies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LOG_TAIL_LINES = 20


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A preexec hook: the child gets SIGTERM when this supervisor dies (Linux only)."""

    def hook() -> None:
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return hook


@dataclass
class Child:
    """A process started by ``up``: the leader of its own session and process group."""

    name: str
    args: list[str]
    log: Path
    popen: subprocess.Popen[bytes]
    stop_timeout: float

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> bool:
        """Whether the child has exited, *without* reaping it.

        While the exited child is an unreaped zombie its PID (= its process group id)
        cannot be reused, so ``kill_group`` can safely sweep up what it left behind.
        """
        if self.popen.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self.popen.poll() is not None
        return info is not None

    def terminate(self) -> None:
        """Ask the child to shut down its own way (gunicorn, Celery, Flower handle SIGTERM)."""
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL the child's process group, then reap the child."""
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()

    def describe_exit(self) -> str:
        code = self.popen.returncode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "    (no log)"
        tail = text.splitlines()[-lines:] or ["(empty)"]
        return "\n".join(f"    | {line}" for line in tail)


def spawn(
    name: str, args: list[str], env: dict[str, str], log_dir: Path, stop_timeout: float
) -> Child:
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            args,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Safe here: the supervisor starts its children before it has any threads.
            preexec_fn=_die_with_parent(os.getpid()),
        )
    return Child(name, args, log, popen, stop_timeout)


# -- helpers --------------------------------------------------------------------------------
