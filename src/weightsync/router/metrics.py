"""Prometheus metrics of the router: per-worker gauges read from the view at scrape time,
counters for routed requests, refusals and fencings, and rolling-update progress."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from weightsync.edge.metrics import Series
from weightsync.router.view import FleetView


class _ViewCollector(Collector):
    def __init__(self, view: FleetView) -> None:
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "routable": GaugeMetricFamily(
                "weightsync_router_worker_routable", "1 while the worker takes requests", labels=["worker"]
            ),
            "fenced": GaugeMetricFamily(
                "weightsync_router_worker_fenced",
                "1 while the worker is fenced or unreachable",
                labels=["worker"],
            ),
            "in_flight": GaugeMetricFamily(
                "weightsync_router_worker_in_flight",
                "requests routed to the worker not yet finished",
                labels=["worker"],
            ),
        }
        for w in self.view.workers.values():
            families["routable"].add_metric([w.url], float(w.machine.routable))
            families["fenced"].add_metric([w.url], float(w.machine.fenced))
            families["in_flight"].add_metric([w.url], float(w.in_flight))
        yield from families.values()
        yield GaugeMetricFamily(
            "weightsync_router_fleet_epoch",
            "the newest committed fleet epoch (0 before any commit)",
            value=float(self.view.newest_epoch),
        )


class RouterMetrics:
    """One registry per router, so several can live in one process."""

    def __init__(self, view: FleetView) -> None:
        series = Series(_ViewCollector(view))
        self.registry = series.registry
        # fmt: off
        self.routed = series.counter("weightsync_router_requests",
            "completions routed, by worker and outcome (ok, worker_error, failed, mismatch)", "worker", "outcome")
        self.refusals = series.counter("weightsync_router_refusals",
            "completions the router answered itself, by reason (error code)", "reason")
        self.fencings = series.counter("weightsync_router_fencings",
            "moves of a worker into fenced or unreachable, by worker and reason", "worker", "reason")
        self.updates = series.counter("weightsync_router_fleet_updates",
            "fleet updates run through the router, by outcome code", "code")
        self.batches_total = series.gauge("weightsync_router_rolling_update_batches",
            "batches of the current (or last) fleet update")
        self.batches_done = series.gauge("weightsync_router_rolling_update_batches_done",
            "batches of the current (or last) fleet update committed and returned to routing")
        self.updating = series.gauge("weightsync_router_update_in_progress", "1 while a fleet update runs")
        # fmt: on
        # Each routed request counts once: its child is looked up here, not per request.
        self._routed: dict[tuple[str, str], Counter] = {
            (worker, outcome): self.routed.labels(worker, outcome)
            for worker in view.workers
            for outcome in ("ok", "worker_error", "failed")
        }
        for reason in ("no_worker", "no_fresh_worker", "worker_failed", "reply_mismatch"):
            self.refusals.labels(reason)

    def routed_to(self, worker: str, outcome: str) -> Counter:
        """The ``routed`` counter of ``worker`` and ``outcome``."""
        child = self._routed.get((worker, outcome))
        if child is None:
            child = self._routed[worker, outcome] = self.routed.labels(worker, outcome)
        return child
