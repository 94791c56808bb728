"""``tokenrelay up``'s supervision, with real processes: ports left in TIME_WAIT are free
for the servers; a child that dies is restarted with backoff; one that keeps dying stops
the stack with a clear message and leaves no process behind.

The first tests drive ``workers.supervise`` with tiny shell children (fast, no CPU); the
last ones run the real stack (``up --engine echo``) and SIGKILL its children.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from broker.server import RedisServer, port_is_free
from tests.stack import wait_for
from tests.upstack import (
    MODEL,
    UpRun,
    get,
    in_time_wait,
    leave_time_wait,
    listed_files,
    pid_alive,
    start_up,
    upload_file,
)
from workers.supervise import GiveUp, RestartPolicy, Supervisor

# -- ports ----------------------------------------------------------------------------------


def test_a_port_in_time_wait_is_free_for_the_servers() -> None:
    port = leave_time_wait()
    # The old probe (a bind without SO_REUSEADDR) calls it busy ...
    with socket.socket() as plain, pytest.raises(OSError) as busy:
        plain.bind(("127.0.0.1", port))
    assert busy.value.errno == errno.EADDRINUSE
    # ... but gunicorn, Tornado and redis-server bind with SO_REUSEADDR, and so does the probe.
    assert port_is_free("127.0.0.1", port)
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        assert in_time_wait(port)  # still there: the probe did not wait it out
        assert not port_is_free("127.0.0.1", port)  # a listening server makes it busy


def test_a_listening_port_is_busy_on_the_wildcard_address_too() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = int(server.getsockname()[1])
        assert not port_is_free("127.0.0.1", port)
        assert not port_is_free("0.0.0.0", port)


# -- the supervisor, with tiny children -------------------------------------------------------


class Reports(list[str]):
    def __call__(self, message: str) -> None:
        self.append(message)


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[tuple[Supervisor, Reports]]:
    reports = Reports()
    sup = Supervisor(tmp_path, RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.1), reports)
    try:
        yield sup, reports
    finally:
        sup.stop([], lambda: True, reports)


def poll_until(sup: Supervisor, cond: object, timeout: float) -> None:
    def step() -> bool:
        sup.poll()
        return bool(cond() if callable(cond) else cond)

    wait_for(step, timeout, "the supervisor", interval=0.02)


def test_a_killed_child_is_restarted_after_a_backoff(
    supervisor: tuple[Supervisor, Reports],
) -> None:
    sup, reports = supervisor
    first = sup.start("streamer", sh("echo started $$; exec sleep 30"), dict(os.environ), 5)
    wait_for(lambda: "started" in first.log.read_text(), 5, "the child to log")
    os.kill(first.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    poll_until(sup, lambda: sup.slots["streamer"].child.pid != first.pid, 5)
    assert time.monotonic() - killed_at >= 0.1  # the backoff
    second = sup.slots["streamer"].child
    assert not pid_alive(first.pid) and pid_alive(second.pid)
    assert sup.slots["streamer"].restarts == 1
    assert reports[0] == (
        f"streamer (pid {first.pid}) exited unexpectedly (killed by SIGKILL); restarting it "
        f"in 0.1 s (restart 1 of at most 2 within 60 s; log: {first.log})"
    )
    assert reports[1] == f"streamer restarted (pid {second.pid})"
    wait_for(lambda: f"started {second.pid}" in second.log.read_text(), 5, "the restart to log")
    log = second.log.read_text()  # both runs' output, with a marker between them
    assert f"started {first.pid}" in log
    assert "--- tokenrelay up: streamer exited (killed by SIGKILL); restart 1 at" in log


def test_a_json_logging_child_s_restart_marker_is_a_json_line(
    supervisor: tuple[Supervisor, Reports],
) -> None:
    """With ``TOKENRELAY_LOG_FORMAT=json`` every line of a child's log parses, the
    marker ``up`` writes between its runs included (an ``up`` log line)."""
    sup, _ = supervisor
    env = {**os.environ, "TOKENRELAY_LOG_FORMAT": "json"}
    line = '{"message": "started"}'
    first = sup.start("worker", sh(f"echo '{line}'; exec sleep 30"), env, 5)
    wait_for(lambda: "started" in first.log.read_text(), 5, "the child to log")
    os.kill(first.pid, signal.SIGKILL)
    poll_until(sup, lambda: sup.slots["worker"].child.pid != first.pid, 5)
    second = sup.slots["worker"].child
    wait_for(lambda: second.log.read_text().count("started") == 2, 5, "the restart to log")
    lines = [json.loads(x) for x in second.log.read_text().splitlines()]  # every line
    assert [x["message"] for x in lines] == [
        "started",
        "tokenrelay up: worker exited (killed by SIGKILL); restart 1",
        "started",
    ]
    assert lines[1]["process"] == "up" and lines[1]["level"] == "WARNING"


def test_a_child_that_keeps_dying_is_given_up_with_its_last_lines(
    supervisor: tuple[Supervisor, Reports],
) -> None:
    sup, _ = supervisor
    sup.start("batcher", sh("echo cannot go on $$ >&2; exit 7"), dict(os.environ), 5)
    started = time.monotonic()
    with pytest.raises(GiveUp) as gave_up:
        poll_until(sup, False, 10)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 5  # backoffs of 0.1 s then 0.2 s, then the third exit
    last = sup.slots["batcher"].child
    message = str(gave_up.value)
    assert message.startswith(
        f"batcher (pid {last.pid}) keeps exiting: 3 exits within 60 s, the last with exit "
        "status 7; not restarting it again (limit: --max-restarts 2 within --restart-window 60)"
        f"; last lines of {last.log}:\n"
    )
    assert f"    | cannot go on {last.pid}" in message
    assert sup.slots["batcher"].restarts == 2
    assert not pid_alive(last.pid)


def test_an_exit_a_restart_cannot_fix_is_given_up_at_once(
    supervisor: tuple[Supervisor, Reports],
) -> None:
    sup, reports = supervisor
    child = sup.start(
        "worker", sh("echo cannot start the engine; exit 3"), dict(os.environ), 5, (3,)
    )
    with pytest.raises(GiveUp) as gave_up:
        poll_until(sup, False, 5)
    assert str(gave_up.value).startswith(
        f"worker (pid {child.pid}) exited (exit status 3), which a restart cannot fix"
    )
    assert "    | cannot start the engine" in str(gave_up.value)
    assert not reports  # never restarted


def test_a_stop_while_a_child_waits_for_its_restart_starts_nothing(tmp_path: Path) -> None:
    reports = Reports()
    sup = Supervisor(tmp_path, RestartPolicy(backoff_s=30), reports)
    child = sup.start("flower", sh("exit 1"), dict(os.environ), 5)
    other = sup.start("web", sh("exec sleep 30"), dict(os.environ), 5)
    poll_until(sup, lambda: sup.slots["flower"].restart_at is not None, 5)
    sup.stop([("web",), ("flower",)], lambda: False, reports)
    sup.poll()
    assert sup.slots["flower"].child is child and sup.slots["flower"].restarts == 0
    assert not pid_alive(other.pid)
    assert other.popen.returncode == -signal.SIGTERM


# -- the real stack ---------------------------------------------------------------------------


def group_members(pgid: int) -> set[int]:
    """The PIDs of the live processes in process group ``pgid`` (from /proc)."""
    members = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.add(int(entry.name))
    return members


def chat(api: str, text: str) -> str:
    with openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=30) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=32
        )
    return reply.choices[0].message.content or ""


def restarted(run: UpRun, name: str, old_pid: int, timeout: float = 30) -> int:
    def new_pid() -> int:
        child = run.state().get("children", {}).get(name, {})
        pid = int(child.get("pid", old_pid))
        return pid if pid != old_pid else 0

    pid = wait_for(new_pid, timeout, f"{name} to be restarted", interval=0.2)
    assert isinstance(pid, int)
    return pid


def serves_again(api: str, text: str, since: float, timeout: float) -> float:
    """Seconds from ``since`` (the kill) until a chat request gets exactly ``text`` back."""
    last: object = None
    while time.monotonic() - since < timeout:
        try:
            last = chat(api, text)
            if last == text:
                return round(time.monotonic() - since, 1)
        except openai.APIError as exc:  # 503 while a worker or streamer is missing
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"not serving {timeout}s after the kill; last answer: {last!r}")


def kill(pid: int) -> float:
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_up_restarts_its_killed_children_and_serves_again(tmp_path: Path, models_dir: Path) -> None:
    run = start_up(tmp_path, models_dir)
    try:
        urls = run.wait_ready(120)["urls"]
        assert chat(urls["api"], "before any kill") == "before any kill"
        file_id = upload_file(urls["api"], b'{"custom_id": "kept"}\n')

        pids = run.recorded_pids()
        recovery: dict[str, float] = {}
        new: dict[str, int] = {}
        # The streamer: SIGKILLed, restarted, and the stack answers exactly again.
        killed = kill(pids["streamer"])
        new["streamer"] = restarted(run, "streamer", pids["streamer"])
        recovery["streamer"] = serves_again(urls["api"], "after the streamer", killed, 30)

        # The worker (a Celery worker with its engine thread): the same.
        killed = kill(pids["worker"])
        new["worker"] = restarted(run, "worker", pids["worker"])
        recovery["worker"] = serves_again(urls["api"], "after the worker", killed, 60)

        # The web server: its gunicorn master SIGKILLed; the workers it left holding the
        # port are swept up, and the new one binds the same port.
        web_group = group_members(pids["web"])
        assert len(web_group) >= 2, web_group  # master + its worker(s)
        killed = kill(pids["web"])
        new["web"] = restarted(run, "web", pids["web"])
        assert not any(pid_alive(pid) for pid in web_group), web_group
        recovery["web"] = serves_again(urls["api"], "after the web server", killed, 30)

        # The private Redis: restarted on the same port with its append-only file, so the
        # uploaded file is still there.
        killed = kill(pids["redis"])
        new["redis"] = restarted(run, "redis", pids["redis"])
        recovery["redis"] = serves_again(urls["api"], "after redis", killed, 60)
        assert file_id in listed_files(urls["api"])

        # Flower: back on the same port, with the same password.
        killed = kill(pids["flower"])
        new["flower"] = restarted(run, "flower", pids["flower"])
        auth = run.flower_auth()
        wait_for(lambda: get(urls["flower"] + "healthcheck", auth)[0] == 200, 30, "Flower")
        recovery["flower"] = round(time.monotonic() - killed, 1)

        out = run.output()
        state = run.state()["children"]
        for name, old in pids.items():
            if name == "up":
                continue
            if name == "batcher":  # never killed
                assert state[name]["restarts"] == 0 and state[name]["pid"] == old
                continue
            assert f"{name} (pid {old}) exited unexpectedly (killed by SIGKILL); restarting" in out
            assert state[name]["restarts"] == 1
            assert state[name]["last_exit"] == "killed by SIGKILL"
        print(f"recovery after SIGKILL (s): {recovery}")

        run.popen.send_signal(signal.SIGTERM)
        assert run.wait_exit(60) == 0, run.logs()
        everything = {**pids, **{f"new {name}": pid for name, pid in new.items()}}
        alive = {name: pid for name, pid in everything.items() if pid_alive(pid)}
        assert not alive, f"left running: {alive}"
    finally:
        run.cleanup()


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_child_that_keeps_dying_stops_up_with_a_clear_message(
    tmp_path: Path, models_dir: Path
) -> None:
    # A models dir of our own, so it can break under the running stack: a streamer that
    # starts again cannot load the model, every time.
    models = tmp_path / "models"
    shutil.copytree(models_dir / MODEL, models / MODEL, copy_function=os.link)
    # With TOKENRELAY_REDIS_URL, `up` starts no Redis and leaves that one running.
    redis_server = RedisServer().start()
    run = start_up(
        tmp_path,
        models,
        "--max-restarts",
        "2",
        "--restart-window",
        "60",
        TOKENRELAY_REDIS_URL=redis_server.url,
    )
    try:
        run.wait_ready(120)
        pids = run.recorded_pids()
        assert "redis" not in pids
        (models / MODEL).rename(models / "moved-away")
        os.kill(pids["streamer"], signal.SIGKILL)
        started = time.monotonic()
        code = run.wait_exit(90)
        assert code == 1, run.logs()
        out = run.output()
        last = run.state()["children"]["streamer"]
        assert last["restarts"] == 2 and last["last_exit"] == "exit status 1"
        assert (
            f"tokenrelay up: error: streamer (pid {last['pid']}) keeps exiting: 3 exits within "
            "60 s, the last with exit status 1; not restarting it again" in out
        ), out
        assert f"last lines of {run.run_dir / 'logs' / 'streamer.log'}:\n    | " in out
        # The cause is in the lines shown, after the marker of the last restart.
        tail = out.split("keeps exiting")[1]
        assert "--- tokenrelay up: streamer exited (exit status 1); restart 2 at" in tail, out
        assert f"model directory {models / MODEL} does not exist" in tail, out
        assert time.monotonic() - started < 60
        alive = {name: pid for name, pid in run.recorded_pids().items() if pid_alive(pid)}
        assert not alive, f"left running: {alive}"
        assert run.state()["exit_code"] == 1
        assert redis_server.proc is not None and redis_server.proc.poll() is None
    finally:
        run.cleanup()
        redis_server.stop()
