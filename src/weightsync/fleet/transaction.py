"""One transaction while it runs: its durable part (spec, progress) and what it collected."""

from __future__ import annotations

import attrs

from weightsync.core.errors import WeightSyncError
from weightsync.fleet._decide import Frame, Progress
from weightsync.fleet.doubts import Doubts
from weightsync.fleet.records import TransactionSpec

__all__ = ["Transaction"]


@attrs.define
class Transaction:
    """One transaction while it runs.  ``spec`` and ``progress`` are what the journal holds;
    the rest is what its workers said on the way: every error by worker, the workers that
    could not be resumed on the commit, those whose old weights were restored, and the
    declarations sent that got no answer (``doubts``).  ``recovered_from``: the phase a
    recovery found it in, its coordinator having stopped there (``None``: not recovered)."""

    id: int
    spec: TransactionSpec
    progress: Progress
    errors: dict[str, list[WeightSyncError]] = attrs.field(factory=dict)
    resume_failed: set[str] = attrs.field(factory=set)
    rolled: set[str] = attrs.field(factory=set)
    doubts: Doubts = attrs.field(factory=Doubts)
    recovered_from: str | None = None

    @property
    def frame(self) -> Frame:
        return Frame.of(self.spec)

    def fail(self, url: str, exc: WeightSyncError) -> None:
        self.errors.setdefault(url, []).append(exc)
