"""``benchmarks/relay_floor.py`` measures what it says it measures.

Its ``steps-only`` variant edits the production publish and output-write scripts by
text to project a design change (docs/benchmarks.md). If those scripts change, the edit
must fail loudly rather than measure something else, and the edited scripts must still
fence, report cancels and write the step streams: only the per-request entries go.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest
import redis

from app.messages import TokenDelta
from broker.keys import Keys
from broker.requests import PublishItem, RequestStore, encode_deltas
from broker.server import RedisServer
from broker.streams import split_step

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def floor() -> ModuleType:
    saved = list(sys.path)  # the benchmark adds its folders too: none may outlive this
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import relay_floor
    finally:
        sys.path[:] = saved
    return relay_floor


@pytest.mark.parametrize("variant", ["design", "steps-only", "hops"])
def test_every_line_crosses_the_three_processes(floor: ModuleType, variant: str) -> None:
    out = floor.run(4, 12, 400.0, variant)
    assert out["lines"] == 4 * 12
    assert 0 < out["itl_p50_ms"] <= out["itl_p90_ms"]


def test_steps_only_publish_keeps_the_checks_and_drops_the_request_entries(
    floor: ModuleType, redis_server: RedisServer
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys("floor-test:")
    store = RequestStore(client, keys)
    store._publish = client.register_script(floor.STEPS_ONLY_PUBLISH)
    client.set(keys.lease("mine"), "w1:0")
    client.set(keys.lease("lost"), "w2:1")
    client.set(keys.cancel("stopping"), 1)
    client.set(keys.lease("stopping"), "w1:0")
    payload = encode_deltas([TokenDelta(choice=0, token_ids=[7])])
    items = [PublishItem(rid, "w1:0", 0, payload) for rid in ("mine", "lost", "stopping")]
    statuses = store.publish(items, 60, worker_id="w1")
    assert [int(s) for s in statuses] == [0, 1, 2]  # published, fenced, cancel requested
    assert client.exists(keys.tokens("mine"), keys.tokens("stopping")) == 0
    [(_id, fields)] = client.xrange(keys.steps("w1"))
    lines = split_step(fields[b"d"])
    assert [key for key, *_ in lines] == [keys.tokens("mine"), keys.tokens("stopping")]
    assert all(line[3] == payload for line in lines)


def test_steps_only_write_keeps_the_step_entry_and_drops_the_output_entries(
    floor: ModuleType,
) -> None:
    assert "XADD', KEYS[i]" not in floor.STEPS_ONLY_WRITE
    assert "'XLEN'" not in floor.STEPS_ONLY_WRITE
    assert "XPENDING" in floor.STEPS_ONLY_WRITE  # the fence stays
    assert "redis.call('XADD', steps" in floor.STEPS_ONLY_WRITE
