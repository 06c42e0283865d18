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
    """``phase`` is the terminal phase; ``ok`` only when it committed everywhere."""

    txn: int
    phase: str
    version: Any
    epoch: int | None
    expected_digest: str | None
    policy: str
    workers: tuple[WorkerOutcome, ...]
    code: str | None = None
    message: str | None = None

    @property
    def ok(self) -> bool:
        return self.phase == "committed"

    def worker(self, url: str) -> WorkerOutcome:
        return next(w for w in self.workers if w.url == url)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["workers"] = [w.to_json() for w in self.workers]
        out["ok"] = self.ok
        return out
