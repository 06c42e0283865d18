"""Fleet transactions: one weight version across N workers, all or nothing, attested by digest.

See ``docs/fleet.md``.  :class:`FleetCoordinator` is what a trainer (or the router) calls:
``await FleetCoordinator(urls, journal=path, initial_source=p).update(path, version,
max_unavailable=k, ...)`` with ``before_pause`` / ``after_commit`` hooks for a rolling update; the CLI
(``weightsync fleet ...``) is a thin shell over it.  Names load on first use, so the
top-level CLI can register ``fleet`` without importing httpx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_dir, lazy_exports

if TYPE_CHECKING:
    from weightsync.fleet._state import STATES, TABLE, TERMINAL, TransactionMachine
    from weightsync.fleet.admission import Admission, admit
    from weightsync.fleet.adoption import Adoption, adopt
    from weightsync.fleet.channel import Channel
    from weightsync.fleet.coordinator import FleetCoordinator, recover
    from weightsync.fleet.delta_channel import DeltaChannel, delta_transaction
    from weightsync.fleet.disk_channel import DiskChannel, checkpoint_digest
    from weightsync.fleet.events import Event
    from weightsync.fleet.journal import Journal
    from weightsync.fleet.push import PushChannel, push_transaction
    from weightsync.fleet.records import Held, TransactionSpec, WorkerRecord
    from weightsync.fleet.result import OUTCOMES, TransactionResult, WorkerOutcome, WorkerStatus
    from weightsync.fleet.samples import SampleReport, verify_samples
    from weightsync.fleet.urls import worker_url

_WHERE = {
    "STATES": "._state", "TABLE": "._state", "TERMINAL": "._state", "TransactionMachine": "._state",
    "Adoption": ".adoption", "adopt": ".adoption", "Held": ".records", "TransactionSpec": ".records", "WorkerRecord": ".records",
    "Channel": ".channel", "DiskChannel": ".disk_channel", "checkpoint_digest": ".disk_channel",
    "Event": ".events", "FleetCoordinator": ".coordinator", "recover": ".coordinator",
    "Journal": ".journal", "PushChannel": ".push", "push_transaction": ".push", "WorkerStatus": ".result", "worker_url": ".urls",
    "OUTCOMES": ".result", "TransactionResult": ".result", "WorkerOutcome": ".result",
    "Admission": ".admission", "admit": ".admission", "DeltaChannel": ".delta_channel",
    "delta_transaction": ".delta_channel", "SampleReport": ".samples", "verify_samples": ".samples",
}  # fmt: skip
__all__ = [
    "OUTCOMES", "STATES", "TABLE", "TERMINAL", "Admission", "Adoption", "Channel", "DeltaChannel", "DiskChannel", "Event", "FleetCoordinator",
    "Held", "Journal", "PushChannel", "SampleReport", "TransactionMachine", "TransactionResult", "TransactionSpec", "WorkerOutcome",
    "WorkerRecord", "WorkerStatus", "admit", "adopt", "checkpoint_digest", "delta_transaction", "push_transaction",
    "recover", "verify_samples", "worker_url",
]  # fmt: skip

__getattr__ = lazy_exports(__name__, _WHERE)
__dir__ = lazy_dir(globals(), __all__)
