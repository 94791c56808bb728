"""The usage ledger in Redis: per key, model and API, per UTC day and hour, what the
finished requests used (issue 44; the fields and their codec are ``app.usage``).

Written once per finished request, where the request finishes: the streamer that writes
its terminal output entry (usage, or a request-level error) hands the entry's
``UsageCount`` to ``OutputStreams.write``, and ``scripts.WRITE_OUTPUTS`` counts it in the
same Lua call as the entry, guarded by ``Keys.usage_done(rid)`` (SET NX). So a streamer
killed before the call leaves the request to the streamer that takes it over, which
writes the end and counts it; one killed after it has counted it already; and nothing a
retry, a takeover or a resume redoes counts it twice (``ledger_call`` builds the call's
part; the guard lives 2 x ``stream_ttl_s``, longer than anything can end the request
again). A web process never writes the ledger: it may die mid-stream.

Read by the admin API (``UsageLedger.read``: one HGETALL per period, one round trip) and
the web tier's metrics (``UsageLedger.totals``: the all-time hash).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from app.usage import UsageCount, UsageQuery, UsageRow, day_of, fold_rows, fold_totals, hour_of
from broker.keys import Keys

DAY_S = 24 * 3600


def ledger_call(
    keys: Keys,
    counts: Sequence[tuple[int, str, UsageCount]],
    *,
    done_ttl_s: int,
    days: int,
) -> tuple[list[str], list[Any]]:
    """``scripts.WRITE_OUTPUTS``' ledger keys and arguments (appended after the rest of
    the call's) for ``counts``: (the entry's 1-based index among those the call writes
    out, its request id, its count). No counts: no key and one argument, 0."""
    if not counts:
        return [], [0]
    ks: list[str] = [keys.usage_total]
    args: list[Any] = []
    for index, rid, count in counts:
        ks += [keys.usage_done(rid), keys.usage_day(day_of(count.at))]
        ks.append(keys.usage_hour(hour_of(count.at)))
        args += [index, count.label, *count.increments]
    # A period's hash lives ``days`` after its last count (its period's end, give or take).
    args += [done_ttl_s, days * DAY_S, len(counts)]
    return ks, args


class UsageLedger:
    """Reads of the usage ledger (its writes ride on the streamer's output writes)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys

    def read(self, query: UsageQuery) -> list[UsageRow]:
        """The rows of every period ``query`` names: one HGETALL each (per shard on a
        Redis Cluster, whose counts are summed), one round trip."""
        shards = self.keys.all_shards()
        pipe = self.redis.pipeline(transaction=False)
        for period in query.periods:
            for k in shards:
                pipe.hgetall(
                    k.usage_hour(period) if query.granularity == "hour" else k.usage_day(period)
                )
        raw = pipe.execute()
        n = len(shards)
        hashes = [_summed(raw[i * n : (i + 1) * n]) for i in range(len(query.periods))]
        return fold_rows(zip(query.periods, hashes, strict=True), query)

    def totals(self) -> dict[tuple[str, str, str], dict[str, int]]:
        """All time: (owner, model, api) -> metric -> count."""
        if not self.keys.clustered:
            raw: Any = self.redis.hgetall(self.keys.usage_total)
            return fold_totals(raw)
        pipe = self.redis.pipeline(transaction=False)
        for k in self.keys.all_shards():
            pipe.hgetall(k.usage_total)
        return fold_totals(_summed(pipe.execute()))


def _summed(hashes: Sequence[Any]) -> Any:
    """One ledger hash from one per shard (the hash itself on one Redis)."""
    if len(hashes) == 1:
        return hashes[0]
    total: dict[bytes, int] = {}
    for h in hashes:
        for field, value in h.items():
            total[field] = total.get(field, 0) + int(value)
    return {field: str(v).encode() for field, v in total.items()}
