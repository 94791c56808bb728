"""A metric family built at scrape time, declared once: its name, type, labels and help.

The families ``/metrics`` reads from Redis when it is scraped (``web.cluster_metrics``,
``web.usage_metrics``) are not prometheus-client objects that exist before the scrape,
so nothing would list them. Each is declared as a ``FamilySpec`` instead and built only
from it (``build``); the collector lists its declarations (``CLUSTER_FAMILIES``), and
docs/operations.md's table is generated from them (``web.metrics_docs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ScrapeFamily = CounterMetricFamily | GaugeMetricFamily


@dataclass(frozen=True)
class FamilySpec:
    """One family: ``name`` as prometheus-client takes it (a counter's without
    ``_total``, which the exposition adds), ``help`` as the scrape shows it."""

    name: str
    type: Literal["counter", "gauge"]
    help: str
    labels: tuple[str, ...] = ()

    def build(self) -> ScrapeFamily:
        """An empty family of this declaration, for the collector to add samples to."""
        kind = CounterMetricFamily if self.type == "counter" else GaugeMetricFamily
        return kind(self.name, self.help, labels=list(self.labels))
