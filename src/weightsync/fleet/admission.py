"""Admitting a worker to a fleet at its committed version: ``weightsync fleet add``.

A new worker, or a member that fell behind (restarted on an older checkpoint, fenced), joins
only once it holds the fleet's committed version and proves it:

1. the journal holds no unfinished transaction and has committed a version (the member row
   with the highest epoch: its version, epoch and digest);
2. each worker is caught up (:func:`weightsync.fleet.catchup.catch_up`): what it serves is
   re-hashed (what it reports is only a claim); unless that proves it on the commit, it is
   refused untouched where no route reaches the commit, else paused, taken along
   the journal's chain of deltas (or a full checkpoint where that is cheaper or no chain
   reaches it), every hop checked, then the committed version declared at the committed
   epoch guarded by the digest and read back — and only then resumed;
3. each worker that was admitted is recorded as a member (its committed row, transaction 0).

A worker that cannot be brought there stays paused and is not recorded; the router never
routes to a worker whose (version, epoch, digest) the journal did not commit for it.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from weightsync.core.errors import IllegalState, WeightSyncError
from weightsync.fleet.catchup import Known, catch_up, newest
from weightsync.fleet.doubts import Doubts, said
from weightsync.fleet.records import CommittedRow
from weightsync.fleet.result import Advice, Brought, WorkerStatus

if TYPE_CHECKING:
    from weightsync.fleet.coordinator import FleetCoordinator

__all__ = ["Admission", "admit"]


Admission = Brought
"""What ``admit`` did: the commit the workers were brought to and each one's state after
(``ok`` when every worker was admitted and recorded)."""

ADVICE = Advice(
    stuck=(
        "{workers} could not be brought onto the commit: check them (`weightsync fleet status "
        "--journal ...`), give the fleet a checkpoint of the commit, then run `weightsync fleet add` again"
    ),
    done="nothing: the workers serve the committed version; name them in the next `weightsync fleet update`",
)


async def admit(
    coordinator: FleetCoordinator, pause_mode: str = "keep", deadline_s: float = 600.0
) -> Admission:
    """Bring every worker of ``coordinator`` onto the fleet's committed version and record it
    as a member (see the module).

    Returns the :class:`Admission`.  Raises ``IllegalState`` (``unfinished_transaction``,
    ``nothing_committed``, ``journal_locked``) before any worker is touched.
    """
    journal, fanout = coordinator.journal, coordinator.fanout
    journal.acquire(coordinator.lease_s)
    try:
        if journal.unfinished():
            raise IllegalState(
                "the journal holds an unfinished transaction: run `weightsync fleet recover` first",
                code="unfinished_transaction",
            )
        row = newest(journal)
        if row is None or row.digest is None:
            raise IllegalState(
                "the journal has committed no version to admit a worker at: run `weightsync fleet "
                "update` (or `adopt`) first",
                code="nothing_committed",
            )
        known, not_after = Known.of(journal), round(time.time() + deadline_s, 3)
        scripts = {u: catch_up(u, known, row, not_after, pause_mode) for u in coordinator.workers}
        doubts = Doubts()
        done, failed = await fanout.play(
            "admit", scripts, time.monotonic() + deadline_s, doubts.aside("admit", coordinator.emit)
        )
        await doubts.settle(
            said("admit", coordinator.emit), "declaration"
        )  # reported only once no declaration it sent can land
        source = known.checkpoints.get(row.digest)
        journal.adopt([(u, CommittedRow(source, row.version, row.epoch, row.digest)) for u in done])
        coordinator.emit("admit", None, "admitted", f"version {row.version!r}, {len(done)} worker(s)")
        statuses = tuple(WorkerStatus(u, done.get(u), failed.get(u)) for u in coordinator.workers)
        return Brought(row.version, row.epoch, row.digest, statuses, ADVICE)
    finally:
        await fanout.close()
        with contextlib.suppress(WeightSyncError):
            journal.release()
