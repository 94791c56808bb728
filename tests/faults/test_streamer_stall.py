"""A streamer stalls (SIGSTOP) while it decodes a request, until another streamer has
taken the request over (the takeover time plus up to a heartbeat), then wakes up
(SIGCONT). The one that wakes must notice and drop the request rather than write it
too: the client gets the text exactly once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from broker.handoff import GROUP
from tests.pipeline import Client, OutageReader, classify, reference
from tests.stack import full_stack, isolated_settings, make_record

pytestmark = pytest.mark.faults

TAKEOVER_S = 2.0
LONG_TEXT = " ".join(f"word{i}" for i in range(40))  # ~80 tokens: ~8 s at 10 tokens/s


@pytest.mark.timeout(90)
def test_a_stalled_streamer_does_not_repeat_text(
    models_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    settings = isolated_settings(
        "redis://unused", models_dir, echo_tokens_per_second=10.0, streamer_takeover_s=TAKEOVER_S
    )
    with full_stack(settings, tmp_path, streamers=("s1", "s2"), web=None) as stack:
        settings, s1, s2 = stack.settings, stack.procs["s1"], stack.procs["s2"]
        client = Client(settings)
        reader = OutageReader(settings)
        ids = tokenizer.encode(LONG_TEXT, add_special_tokens=False).ids
        record = make_record(settings, [ids], max_tokens=200)
        client.submit(record)
        f = reader.follow(record)
        reader.poll(time.monotonic() + 20, stop=lambda: any(e.text for e in f.events))
        (pending,) = client.redis.xpending_range(
            client.store.keys.new_requests, GROUP, min="-", max="+", count=10
        )
        owner = pending["consumer"].decode()
        stalled = {s1.pid: s1, s2.pid: s2}[int(owner.rsplit("-", 2)[-2])]
        os.kill(stalled.pid, signal.SIGSTOP)
        try:
            # Stalled until the other streamer has taken the request over: that
            # takes the takeover time plus up to one heartbeat period (longer on a
            # loaded machine), so wait for it rather than for a fixed time.
            took_over = wait_for_new_owner(client, owner, deadline=time.monotonic() + 30)
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        assert took_over, "no streamer took the stalled streamer's request over"
        reader.poll(time.monotonic() + 20)
        assert s1.alive() and s2.alive()
        logs = stalled.output()
    want = reference(tokenizer, record)
    assert classify(f, want) == "exact", (f.result.texts, want.texts, logs)
    assert f.result.usage is not None and f.result.usage["streamer"] != owner
    # Dropped when it woke (it saw it had stalled), or, stopped between decoding and
    # writing, by the write itself: fenced, since the hand-off entry is not its own.
    assert "was taken over by" in logs


def wait_for_new_owner(client: Client, owner: str, deadline: float) -> bool:
    """Poll the hand-off group until its one pending entry belongs to someone else."""
    while time.monotonic() < deadline:
        pending = client.redis.xpending_range(
            client.store.keys.new_requests, GROUP, min="-", max="+", count=10
        )
        if pending and pending[0]["consumer"].decode() != owner:
            return True
        time.sleep(0.1)
    return False
