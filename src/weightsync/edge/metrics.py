"""A service's Prometheus series, declared one per line.

Each worker app and each router owns its registry, so several live in one process (tests run
many) without two claiming one name.  Imported only by the front doors that serve
``/metrics``: :mod:`weightsync.edge` itself loads no Prometheus client.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

__all__ = ["Series"]


class Series:
    """One registry, holding ``collectors`` (read at scrape time) and the series declared
    through :meth:`counter`, :meth:`gauge` and :meth:`histogram`."""

    def __init__(self, *collectors: Collector) -> None:
        self.registry = CollectorRegistry()
        for collector in collectors:
            self.registry.register(collector)

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        """A counter ``name`` in this registry, labelled by ``labels``."""
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        """A gauge ``name`` in this registry, labelled by ``labels``."""
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, *labels: str, buckets: Sequence[float]) -> Histogram:
        """A histogram ``name`` in this registry over ``buckets``, labelled by ``labels``."""
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
