"""One transaction while it runs: its durable part (spec, progress) and what it collected."""

from __future__ import annotations

import attrs

from weightsync.core.errors import WeightSyncError
from weightsync.fleet._decide import Frame, Progress
from weightsync.fleet.records import TransactionSpec

__all__ = ["Transaction"]


@attrs.define
class Transaction:
    """One transaction while it runs.  ``spec`` and ``progress`` are what the journal holds;
    the rest is what its workers said on the way: every error by worker, the workers that
    could not be resumed on the commit, those whose old weights were restored, and per
    worker when the last declaration sent to it that got no answer can no longer land (unix
    seconds, the coordinator's clock)."""

    id: int
    spec: TransactionSpec
    progress: Progress
    errors: dict[str, list[WeightSyncError]] = attrs.field(factory=dict)
    resume_failed: set[str] = attrs.field(factory=set)
    rolled: set[str] = attrs.field(factory=set)
    in_doubt: dict[str, float] = attrs.field(factory=dict)

    @property
    def frame(self) -> Frame:
        return Frame.of(self.spec)

    def fail(self, url: str, exc: WeightSyncError) -> None:
        self.errors.setdefault(url, []).append(exc)

    def doubt(self, url: str, until: float) -> None:
        """A declaration sent to ``url`` got no answer: it may land until ``until``."""
        self.in_doubt[url] = max(until, self.in_doubt.get(url, until))
