"""One transaction while it runs: its durable part (spec, progress) and what it collected."""

from __future__ import annotations

import attrs

from weightsync.core.errors import WeightSyncError
from weightsync.fleet._decide import Plan, Progress
from weightsync.fleet._values import TransactionSpec

__all__ = ["Run"]


@attrs.define
class Run:
    """One transaction while it runs (its durable part is ``spec`` and ``progress``)."""

    id: int
    spec: TransactionSpec
    progress: Progress
    errors: dict[str, list[WeightSyncError]] = attrs.field(factory=dict)
    resume_failed: set[str] = attrs.field(factory=set)
    rolled: set[str] = attrs.field(factory=set)

    @property
    def plan(self) -> Plan:
        s = self.spec
        return Plan(s.urls, s.policy, s.min_workers, s.max_unavailable)

    def fail(self, url: str, exc: WeightSyncError) -> None:
        self.errors.setdefault(url, []).append(exc)
