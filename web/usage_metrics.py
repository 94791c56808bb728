"""The usage ledger's all-time counters as Prometheus counters, read from Redis at scrape
time (``broker.usage_ledger``; ``web.metrics.ClusterCollector`` yields them).

``tokenrelay_usage_{requests,prompt_tokens,cached_tokens,completion_tokens,errors}_total``
labelled ``key`` (the owner's first 16 characters: a managed key's id, an environment
key's hash prefix; never a secret), ``model`` and ``api``. Every web process reports the
same cluster-wide values (sum by nothing, or scrape one). Bounded: at most
``MAX_LABEL_SETS`` (key, model, api) sets, the busiest by requests, so a deployment with
many keys cannot blow up its Prometheus; ``tokenrelay_usage_label_sets`` says how many
there are in all (more than the cap: some are left out, read them at /admin/usage).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from app.usage import METRICS
from broker.keys import Keys
from broker.usage_ledger import UsageLedger

MAX_LABEL_SETS = 1000
LABELS = ["key", "model", "api"]
_DOCS = {
    "requests": "Finished requests (the usage ledger, all time).",
    "prompt_tokens": "Prompt tokens of finished requests.",
    "cached_tokens": "Prompt tokens of finished requests read from a prefix cache.",
    "completion_tokens": "Completion tokens of finished requests.",
    "errors": "Requests that ended with an error (a request-level one, or a choice's).",
}


def usage_families(
    client: redis.Redis, keys: Keys, *, limit: int = MAX_LABEL_SETS
) -> Iterator[Any]:
    """The usage counters (module doc); nothing when Redis cannot be read."""
    try:
        totals = UsageLedger(client, keys).totals()
    except redis.RedisError:
        return
    busiest = sorted(totals.items(), key=lambda item: (-item[1]["requests"], item[0]))[:limit]
    for metric in METRICS:
        family = CounterMetricFamily(f"tokenrelay_usage_{metric}", _DOCS[metric], labels=LABELS)
        for (owner, model, api), counts in busiest:
            family.add_metric([owner[:16], model, api], float(counts[metric]))
        yield family
    sets = GaugeMetricFamily(
        "tokenrelay_usage_label_sets",
        f"(key, model, api) sets in the usage ledger; at most {limit} are exported.",
    )
    sets.add_metric([], float(len(totals)))
    yield sets
