"""Adopting a running fleet into a journal: the way out of ``untrusted_epoch``.

A journal refuses a worker whose epoch it never issued (another journal, or an in-memory
one, committed it).  When the operator knows the fleet's state is theirs, ``weightsync
fleet adopt`` takes it into the journal — only after checking it is one state:

1. every worker answers, none is torn or mid-update, each one's label describes its weights
   (``version_current``), and they all report one version and one digest
   (``fleet_disagrees`` otherwise, naming what each holds); an epoch at or above
   :data:`~.outcomes.ADOPT_LIMIT` is refused (``untrusted_epoch``: restart that worker);
2. with a ``source``, every worker dry-runs it and must find the digest it holds
   (``initial_source_mismatch``): that is what a later rollback restores;
3. the journal issues an epoch above every worker's, every worker declares its version
   under it (guarded by the digest, read back), and the journal records each one that did
   as committed (transaction 0).

Nothing is declared or recorded when a check fails.  Nothing is paused or resumed.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from weightsync.core.errors import IllegalState, WeightSyncError
from weightsync.fleet import calls
from weightsync.fleet.doubts import Doubts, said
from weightsync.fleet.events import short_digest
from weightsync.fleet.outcomes import ADOPT_LIMIT
from weightsync.fleet.records import CommittedRow
from weightsync.fleet.result import Advice, Brought, WorkerStatus

if TYPE_CHECKING:
    from weightsync.fleet.coordinator import FleetCoordinator

__all__ = ["Adoption", "adopt"]


Adoption = Brought
"""What ``adopt`` did: the version, epoch and digest it committed (from ``source``, when one
was checked), and each worker's state after (``ok`` when every worker declared it and the
journal recorded it)."""

ADVICE = Advice(
    stuck=(
        "{workers} did not take the adopted epoch: check them (`weightsync fleet status --journal "
        "...`), then run `weightsync fleet adopt` again"
    ),
    done="nothing: the journal holds the fleet's state; `weightsync fleet update` commits from here",
)


def _refuse(code: str, message: str) -> IllegalState:
    return IllegalState(f"{message}: nothing was adopted", code=code)


def _one_state(workers: list[str], done: Mapping[str, Any], failed: Mapping[str, WeightSyncError]) -> Any:
    """The (version, digest, highest epoch) every worker agrees on.  Raises ``IllegalState``
    naming the first worker (or disagreement) that makes it not one adoptable state."""
    for url in workers:
        if url in failed:
            raise _refuse(failed[url].code, f"{url} did not answer ({failed[url].message})")
        s = done[url]
        if s.get("torn") is True or s.get("update_in_flight") is True:
            raise _refuse("fleet_disagrees", f"{url} is torn or mid-update")
        if s.get("version_declared") is not True or s.get("version_current") is not True:
            raise _refuse("version_not_current", f"{url}'s label does not describe the weights it holds")
        if not isinstance(s.get("digest"), str):
            raise _refuse("fleet_disagrees", f"{url} reports no digest")
        epoch = s.get("epoch")
        if isinstance(epoch, int) and epoch >= ADOPT_LIMIT:
            raise _refuse("untrusted_epoch", f"{url} reports epoch {epoch}, beyond any journal: restart it")
    held = {(json.dumps(done[u].get("version"), sort_keys=True), done[u]["digest"]) for u in workers}
    if len(held) != 1:
        each = ", ".join(
            f"{u}: {done[u].get('version')!r} {short_digest(done[u]['digest'])}" for u in workers
        )
        raise _refuse("fleet_disagrees", f"the workers hold different weights or labels ({each})")
    epochs = [e for u in workers if isinstance(e := done[u].get("epoch"), int)]
    first = done[workers[0]]
    return first.get("version"), first["digest"], max(epochs, default=0)


async def adopt(
    coordinator: FleetCoordinator, source: str | None = None, deadline_s: float = 60.0
) -> Adoption:
    """Adopt the state every worker of ``coordinator`` holds into its journal (see the
    module's docstring).  ``source``: where those weights load from (absolute, as workers see
    it), checked on every worker; recorded as what a rollback restores.

    Returns the :class:`Adoption`.  Raises ``IllegalState`` (``fleet_disagrees``,
    ``version_not_current``, ``untrusted_epoch``, ``initial_source_mismatch``, the code of a
    worker that did not answer; ``journal_locked``, ``unfinished_transaction``) before
    anything is declared or recorded.
    """
    journal, workers, fanout = coordinator.journal, coordinator.workers, coordinator.fanout
    deadline, not_after = time.monotonic() + deadline_s, round(time.time() + deadline_s, 3)
    journal.acquire(coordinator.lease_s)
    try:
        if journal.unfinished():
            raise _refuse(
                "unfinished_transaction",
                "the journal holds an unfinished transaction: run `weightsync fleet recover` first",
            )
        done, failed = await fanout.play("adopt", {u: calls.read_after(u) for u in workers}, deadline)
        version, digest, floor = _one_state(workers, done, failed)
        if source is not None:
            scripts = {u: calls.restores(u, source, digest) for u in workers}
            _, bad = await fanout.play("adopt", scripts, deadline)
            if bad:
                url = next(u for u in workers if u in bad)
                raise _refuse(bad[url].code, bad[url].message)
        epoch = journal.issue_epoch(floor)
        scripts = {u: calls.declare(u, version, epoch, digest, not_after) for u in workers}
        doubts = Doubts()
        declared, failed = await fanout.play(
            "adopt", scripts, deadline, doubts.aside("adopt", coordinator.emit)
        )
        await doubts.settle(
            said("adopt", coordinator.emit), "declaration"
        )  # recorded and reported only once no declaration it sent can land
        journal.adopt([(u, CommittedRow(source, version, epoch, digest)) for u in workers if u in declared])
        statuses = tuple(WorkerStatus(u, declared.get(u), failed.get(u)) for u in workers)
        coordinator.emit(
            "adopt", None, "adopted", f"version {version!r}, epoch {epoch}, {len(declared)} worker(s)"
        )
        return Brought(version, epoch, digest, statuses, ADVICE, source)
    finally:
        await fanout.close()
        with contextlib.suppress(WeightSyncError):
            journal.release()
