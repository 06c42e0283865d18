"""What a transaction did: one frozen result, naming each worker's outcome and error code."""

from __future__ import annotations

from typing import Any, Final

import attrs

POLICIES: Final = ("rollback", "fence")
PAUSE_MODES: Final = ("keep", "wait", "abort")

# A worker's outcome once the transaction is over.
OUTCOMES: Final = (
    "committed",  # serves the new version, epoch and digest
    "unchanged",  # nothing was written (refused prepare, or released before it loaded)
    "refused",  # refused the dry run: the transaction was aborted, nothing changed
    "rolled_back",  # loaded, then restored to its last committed source and version
    "fenced",  # fence policy: left paused (or torn) and out of the committed set
    "failed",  # could not be brought to any version (unreachable, hung, restore failed)
)


@attrs.frozen
class WorkerOutcome:
    url: str
    outcome: str = attrs.field(validator=attrs.validators.in_(OUTCOMES))
    code: str | None = None  # the first error this worker hit, machine-readable
    message: str | None = None
    digest: str | None = None  # the digest it reported last

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class TransactionResult:
    """``phase`` is the terminal phase; ``committed`` (and ``ok``) when the version was committed.

    A transaction committed when it ended ``committed`` (every worker), or ``fenced`` with at
    least ``min_workers`` workers committed: that is what the ``fence`` policy asked for.
    The fenced workers are still named in ``workers`` (outcome ``fenced``).
    """

    txn: int
    phase: str
    version: Any
    epoch: int | None
    expected_digest: str | None
    policy: str
    workers: tuple[WorkerOutcome, ...]
    code: str | None = None
    message: str | None = None
    min_workers: int | None = None  # the quorum a fenced commit needs

    @property
    def committed(self) -> bool:
        if self.phase == "committed":
            return True
        if self.phase != "fenced" or self.min_workers is None:
            return False
        return sum(w.outcome == "committed" for w in self.workers) >= self.min_workers

    @property
    def ok(self) -> bool:
        return self.committed

    def worker(self, url: str) -> WorkerOutcome:
        return next(w for w in self.workers if w.url == url)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["workers"] = [w.to_json() for w in self.workers]
        out["committed"] = self.committed
        out["ok"] = self.ok
        return out
