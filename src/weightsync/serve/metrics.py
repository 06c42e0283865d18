"""Prometheus metrics of one worker: state gauges read at scrape time, update counters."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from weightsync.core.controller import Controller
from weightsync.core.routes import ROUTES
from weightsync.edge.metrics import Series

UPDATE_ROUTES = tuple(name for name, route in ROUTES.items() if route.update)


class _StateCollector(Collector):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[GaugeMetricFamily | InfoMetricFamily]:
        snap = self.controller.snapshot()
        for name, value, doc in (
            ("weightsync_paused", snap.paused, "1 while generation is paused (or torn)"),
            ("weightsync_torn", snap.torn, "1 while the loaded weights match no version"),
            ("weightsync_version_declared", snap.version_declared, "1 once a version was declared"),
            ("weightsync_update_in_flight", snap.update_in_flight, "1 while an update runs"),
            ("weightsync_commits", snap.commits, "state changes committed since start"),
        ):
            yield GaugeMetricFamily(name, doc, value=float(value))
        yield InfoMetricFamily(
            "weightsync_version",
            "the declared weight version: a string as it is, another JSON value as its JSON text "
            "(type says which); empty while undeclared",
            value=version_labels(snap.version_declared, snap.version_value),
        )
        yield InfoMetricFamily(
            "weightsync_weight_digest",
            "content digest of the weights held (empty while unknown)",
            value={"digest": snap.digest or ""},
        )
        if snap.epoch is not None:  # absent before any fleet commit
            yield GaugeMetricFamily(
                "weightsync_fleet_epoch", "the fleet epoch declared", value=float(snap.epoch)
            )


def version_labels(declared: bool, value: object) -> dict[str, str]:
    """The labels of ``weightsync_version_info``: ``version`` (a string unquoted, any other
    JSON value as its JSON text) and ``type`` (``string``, ``number``, ``boolean``, ``null``,
    ``array``, ``object``; ``undeclared`` before any declaration)."""
    if not declared:
        return {"version": "", "type": "undeclared"}
    if isinstance(value, str):
        return {"version": value, "type": "string"}
    kinds = ((bool, "boolean"), (int | float, "number"), (list, "array"), (dict, "object"))
    kind = next((name for cls, name in kinds if isinstance(value, cls)), "null")
    return {"version": json.dumps(value), "type": kind}


@runtime_checkable
class SeriesOfItsOwn(Protocol):
    """An engine with Prometheus series of its own (vLLM's ``vllm:*``), read at scrape time."""

    def metric_families(self) -> Iterable[Metric]: ...


class _EngineCollector(Collector):
    def __init__(self, engine: SeriesOfItsOwn) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        return self.engine.metric_families()

    def describe(self) -> Iterable[Metric]:
        return ()  # the engine's names are known at scrape time only


class Metrics:
    """One registry per app, so several workers can live in one process (tests do).  An
    engine's own series (:class:`SeriesOfItsOwn`) are served beside the worker's."""

    def __init__(self, controller: Controller) -> None:
        engine = controller.engine
        own = (_EngineCollector(engine),) if isinstance(engine, SeriesOfItsOwn) else ()
        series = Series(_StateCollector(controller), *own)
        self.registry = series.registry
        self.requests = series.counter(
            "weightsync_admin_requests", "admin requests by route and outcome code", "route", "code"
        )
        self.updates = series.counter(
            "weightsync_updates", "weight updates by route and outcome code", "route", "code"
        )
        self.update_seconds = series.histogram(
            "weightsync_update_seconds",
            "duration of successful weight updates",
            "route",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.bytes_moved = series.counter(
            "weightsync_update_bytes", "bytes of weights loaded by successful updates", "route"
        )
        self.completions = series.counter(
            "weightsync_completions", "completions by finish reason", "finish_reason"
        )
        for name in ROUTES:  # every route is a series from the first scrape, at 0 until used
            self.requests.labels(name, "ok")
            if name in UPDATE_ROUTES:
                self.updates.labels(name, "ok")

    def observe(self, route: str, code: str, seconds: float, reply: dict[str, object] | None) -> None:
        self.requests.labels(route, code).inc()
        if route in UPDATE_ROUTES:
            self.updates.labels(route, code).inc()
            if reply is not None and code == "ok":
                self.update_seconds.labels(route).observe(seconds)
                stats = reply.get("stats")
                if isinstance(stats, dict):
                    self.bytes_moved.labels(route).inc(float(stats.get("bytes", 0)))
