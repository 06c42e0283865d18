"""Fleet transactions: one weight version across N workers, all or nothing, attested by digest.

See ``docs/fleet.md``.  :class:`FleetCoordinator` is what a trainer calls; the CLI
(``weightsync fleet ...``) is a thin shell over it.  Names load on first use, so the
top-level CLI can register ``fleet`` without importing httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._state import STATES, TABLE, TERMINAL, TransactionMachine
    from .coordinator import Event, FleetCoordinator, WorkerStatus, checkpoint_digest, recover
    from .journal import Journal
    from .result import OUTCOMES, TransactionResult, WorkerOutcome

_WHERE = {
    "STATES": "._state", "TABLE": "._state", "TERMINAL": "._state", "TransactionMachine": "._state",
    "Event": ".coordinator", "FleetCoordinator": ".coordinator", "WorkerStatus": ".coordinator",
    "checkpoint_digest": ".coordinator", "recover": ".coordinator", "Journal": ".journal",
    "OUTCOMES": ".result", "TransactionResult": ".result", "WorkerOutcome": ".result",
}  # fmt: skip
__all__ = [
    "OUTCOMES", "STATES", "TABLE", "TERMINAL", "Event", "FleetCoordinator", "Journal",
    "TransactionMachine", "TransactionResult", "WorkerOutcome", "WorkerStatus", "checkpoint_digest",
    "recover",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
