"""The usage ledger's all-time counters as Prometheus counters, read from Redis at scrape
time (``broker.usage_ledger``; ``web.cluster_metrics.ClusterCollector`` yields them).

``tokenrelay_usage_{requests,prompt_tokens,cached_tokens,completion_tokens,errors}_total``
labelled ``key`` (the owner's first 16 characters: a managed key's id, an environment
key's hash prefix; never a secret), ``model`` and ``api``. Every web process reports the
same cluster-wide values (sum by nothing, or scrape one). Bounded: at most
``MAX_LABEL_SETS`` (key, model, api) sets, the busiest by requests, so a deployment with
many keys cannot blow up its Prometheus; ``tokenrelay_usage_label_sets`` says how many
there are in all (more than the cap: some are left out, read them at /admin/usage).
Every family is declared in ``USAGE_FAMILIES`` (``web.metric_family``).
"""

from __future__ import annotations

from collections.abc import Iterator

import redis

from app.usage import METRICS
from broker.keys import Keys
from broker.usage_ledger import UsageLedger
from web.metric_family import FamilySpec, ScrapeFamily

MAX_LABEL_SETS = 1000
LABELS = ("key", "model", "api")
_HELP = {
    "requests": "Finished requests (the usage ledger, all time).",
    "prompt_tokens": "Prompt tokens of finished requests.",
    "cached_tokens": "Prompt tokens of finished requests read from a prefix cache.",
    "completion_tokens": "Completion tokens of finished requests.",
    "errors": "Requests that ended with an error (a request-level one, or a choice's).",
}
# One counter per ledger metric, in the ledger's order.
COUNTERS = {
    metric: FamilySpec(f"tokenrelay_usage_{metric}", "counter", _HELP[metric], LABELS)
    for metric in METRICS
}
LABEL_SETS = FamilySpec(
    "tokenrelay_usage_label_sets",
    "gauge",
    f"(key, model, api) sets in the usage ledger; at most {MAX_LABEL_SETS:,} (the most "
    "requests) are exported.",
)
USAGE_FAMILIES = (*COUNTERS.values(), LABEL_SETS)


def usage_families(
    client: redis.Redis, keys: Keys, *, limit: int = MAX_LABEL_SETS
) -> Iterator[ScrapeFamily]:
    """The usage counters (module doc); nothing when Redis cannot be read."""
    try:
        totals = UsageLedger(client, keys).totals()
    except redis.RedisError:
        return
    busiest = sorted(totals.items(), key=lambda item: (-item[1]["requests"], item[0]))[:limit]
    for metric, spec in COUNTERS.items():
        family = spec.build()
        for (owner, model, api), counts in busiest:
            family.add_metric([owner[:16], model, api], float(counts[metric]))
        yield family
    sets = LABEL_SETS.build()
    sets.add_metric([], float(len(totals)))
    yield sets
