"""Children of ``tokenrelay up``: started in their own session, watched without being
reaped, restarted with backoff when they die, stopped by the PID we started (SIGTERM, a
grace period, then SIGKILL to the process group it leads), and given SIGTERM if the
supervisor itself dies.

Restart rules, and why:

* A child that exits on its own is restarted after a backoff that doubles with each exit
  inside the policy's window (0.5 s, 1 s, 2 s, ... up to ``max_backoff_s``): one crash
  (a bug, the OOM killer, a kill by hand) costs the local stack a second, not the stack.
* More than ``max_restarts`` exits within ``window_s`` is a crash loop: restarting again
  would only hide the failure, so the supervisor gives up (``CrashLoop``) and ``up``
  stops everything with the child's name, last exit status and last log lines.
* Exit statuses that say "restarting cannot help" (``fatal_codes``: a usage error, a
  worker whose engine cannot start) give up at once, with the same report.
* The private redis-server is restarted like the rest, on the same port with the same
  data directory, so with its append-only file it comes back with its data and the
  other processes (which reconnect to Redis) carry on.
* A restarted child appends to its log after a marker line, so the output of the run
  that died stays readable next to the new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.logs import JsonFormatter

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 20
#: ``argparse`` exits 2 on a bad command line: the same command line will fail again.
USAGE_ERROR = 2


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


def describe_status(code: int | None) -> str:
    """A ``Popen.returncode`` in words: ``exit status 1``, ``killed by SIGKILL``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


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
        """SIGKILL the child's process group, then reap the child.

        After an unexpected exit this also sweeps up what the child left in its group
        (gunicorn's workers after its master was killed still hold the listening socket).
        """
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()

    def describe_exit(self) -> str:
        return describe_status(self.popen.returncode)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "    (no log)"
        tail = text.splitlines()[-lines:] or ["(empty)"]
        return "\n".join(f"    | {line}" for line in tail)


def spawn(
    name: str,
    args: list[str],
    env: dict[str, str],
    log_dir: Path,
    stop_timeout: float,
    *,
    append: bool = False,
) -> Child:
    log = log_dir / f"{name}.log"
    with log.open("ab" if append else "wb") as out:
        popen = subprocess.Popen(
            args,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Safe here: the supervisor is single-threaded (signal handlers only set flags).
            preexec_fn=_die_with_parent(os.getpid()),
        )
    return Child(name, args, log, popen, stop_timeout)


# -- restarts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again, and when the supervisor gives up on it."""

    max_restarts: int = 5  # restarts allowed within window_s; 0: never restart
    window_s: float = 120.0
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def delay(self, recent_exits: int) -> float:
        """The wait before the next start, given the exits inside the window (>= 1)."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** max(0, recent_exits - 1)))


class GiveUp(Exception):
    """A child died and will not be restarted: the stack must stop (exit status 1)."""

    def __init__(self, slot: Slot, reason: str) -> None:
        child = slot.child
        super().__init__(
            f"{slot.name} (pid {child.pid}) {reason}; last lines of {child.log}:\n"
            f"{child.log_tail()}"
        )
        self.slot = slot


@dataclass
class Slot:
    """One named child of the stack across its restarts."""

    name: str
    args: list[str]
    env: dict[str, str]
    stop_timeout: float
    fatal_codes: frozenset[int]
    child: Child
    exits: deque[float] = field(default_factory=deque)  # monotonic times, inside the window
    restarts: int = 0
    last_exit: str | None = None
    restart_at: float | None = None  # set while the child is dead and waiting for its restart


def restart_marker(slot: Slot) -> bytes:
    """The line between a child's runs in its log: a log line of ``up``'s in the child's
    own format (JSON when its ``TOKENRELAY_LOG_FORMAT`` is json: every line parses)."""
    text = f"tokenrelay up: {slot.name} exited ({slot.last_exit}); restart {slot.restarts}"
    if slot.env.get("TOKENRELAY_LOG_FORMAT", "").strip().lower() == "json":
        record = logging.LogRecord(__name__, logging.WARNING, __file__, 0, text, None, None)
        return (JsonFormatter("up").format(record) + "\n").encode()
    return f"\n--- {text} at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode()


class Supervisor:
    """Starts named children, restarts those that die, stops them phase by phase."""

    def __init__(
        self,
        log_dir: Path,
        policy: RestartPolicy,
        report: Callable[[str], None],
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log_dir = log_dir
        self.policy = policy
        self.report = report
        self.on_change = on_change  # called whenever a PID changes (up.json is rewritten)
        self.clock = clock
        self.slots: dict[str, Slot] = {}

    def start(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        stop_timeout: float,
        fatal_codes: Iterable[int] = (),
    ) -> Child:
        child = spawn(name, args, env, self.log_dir, stop_timeout)
        codes = frozenset({USAGE_ERROR, *fatal_codes})
        self.slots[name] = Slot(name, args, env, stop_timeout, codes, child)
        self.on_change()
        return child

    def poll(self) -> None:
        """Notice exits, start what is due; raises ``GiveUp`` when one must not restart."""
        now = self.clock()
        for slot in self.slots.values():
            if slot.restart_at is None:
                if slot.child.exited():
                    self._exited(slot, now)
            elif now >= slot.restart_at:
                self._restart(slot)

    def _exited(self, slot: Slot, now: float) -> None:
        child = slot.child
        child.kill_group()  # sweeps up what it left in its group, then reaps it
        code = child.popen.returncode
        slot.last_exit = child.describe_exit()
        while slot.exits and now - slot.exits[0] > self.policy.window_s:
            slot.exits.popleft()
        slot.exits.append(now)
        if code in slot.fatal_codes:
            raise GiveUp(slot, f"exited ({slot.last_exit}), which a restart cannot fix")
        if self.policy.max_restarts <= 0:
            raise GiveUp(slot, f"exited unexpectedly ({slot.last_exit})")
        if len(slot.exits) > self.policy.max_restarts:
            raise GiveUp(
                slot,
                f"keeps exiting: {len(slot.exits)} exits within {self.policy.window_s:g} s, "
                f"the last with {slot.last_exit}; not restarting it again "
                f"(limit: --max-restarts {self.policy.max_restarts} "
                f"within --restart-window {self.policy.window_s:g})",
            )
        delay = self.policy.delay(len(slot.exits))
        slot.restart_at = now + delay
        self.report(
            f"{slot.name} (pid {child.pid}) exited unexpectedly ({slot.last_exit}); "
            f"restarting it in {delay:g} s (restart {len(slot.exits)} of at most "
            f"{self.policy.max_restarts} within {self.policy.window_s:g} s; log: {child.log})"
        )

    def _restart(self, slot: Slot) -> None:
        slot.restart_at = None
        slot.restarts += 1
        with slot.child.log.open("ab") as out:
            out.write(restart_marker(slot))
        slot.child = spawn(
            slot.name, slot.args, slot.env, self.log_dir, slot.stop_timeout, append=True
        )
        logger.info("restarted %s as pid %s", slot.name, slot.child.pid)
        self.report(f"{slot.name} restarted (pid {slot.child.pid})")
        self.on_change()

    def stop(
        self,
        phases: Sequence[Sequence[str]],
        force: Callable[[], bool],
        report: Callable[[str], None],
    ) -> None:
        """Stop every child, phase by phase (names not in ``phases`` go first); SIGKILL
        what outlives its grace period, or everything at once when ``force()`` says so."""
        for slot in self.slots.values():
            slot.restart_at = None  # a child waiting for its restart stays down
        known = {name for phase in phases for name in phase}
        ordered = [[n for n in self.slots if n not in known], *phases]
        for names in ordered:
            phase = [self.slots[n].child for n in names if n in self.slots]
            for child in phase:
                child.terminate()
            deadline = time.monotonic() + max((c.stop_timeout for c in phase), default=0)
            while any(not c.exited() for c in phase) and time.monotonic() < deadline:
                if force():
                    break
                time.sleep(0.05)
            for child in phase:
                forced = not child.exited()
                child.kill_group()  # also sweeps up anything the child left in its group
                if forced:
                    report(f"{child.name} (pid {child.pid}) did not stop in time: killed")
