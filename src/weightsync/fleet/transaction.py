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
    worker the latest ``not_after`` of a commit sent to it that got no answer (it may still
    land until then, plus the clock skew)."""

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

    def doubt(self, url: str, not_after: float) -> None:
        """A commit sent to ``url`` got no answer: it may land until ``not_after``."""
        self.in_doubt[url] = max(not_after, self.in_doubt.get(url, not_after))
