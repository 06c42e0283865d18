"""Fleet transactions: one weight version across N workers, all or nothing, attested by digest.

See ``docs/fleet.md``.  :class:`FleetCoordinator` is what a trainer calls; the CLI
(``weightsync fleet ...``) is a thin shell over it.
"""

from __future__ import annotations

from ._state import STATES, TABLE, TERMINAL, TransactionMachine
from .coordinator import Event, FleetCoordinator, WorkerStatus, checkpoint_digest, recover
from .journal import Journal
from .result import OUTCOMES, TransactionResult, WorkerOutcome

__all__ = [
    "OUTCOMES", "STATES", "TABLE", "TERMINAL", "Event", "FleetCoordinator", "Journal",
    "TransactionMachine", "TransactionResult", "WorkerOutcome", "WorkerStatus", "checkpoint_digest",
    "recover",
]  # fmt: skip
