"""The fleet transaction's phases: every legal transition, as data, in this one module.

Theory of operation
-------------------
A fleet transaction moves N workers from one committed version to the next, all or
nothing.  It is a single machine whose state is the transaction's *phase*; which legal
trigger fires after each step is decided by the pure :mod:`._decide`, beside this table.

* ``idle`` → **begin** → ``preparing``: every worker dry-runs the update (validates the
  source, writes nothing) and reports the digest it would hold.  A refusal fires
  **refuse** → ``aborted``: nothing was changed anywhere.  Under ``fence`` a worker that
  did not answer is fenced instead, when the quorum can still be met.
* ``preparing`` → **prepared** → ``applying``: pause, load, reset the prefix cache, on the
  batch's workers concurrently (every worker, unless a rolling update asked for batches of
  ``max_unavailable``).
* ``applying`` → **applied** → ``verifying``: each digest must equal the expected one.
* ``verifying`` → **verified** → ``committing``: declare the version with the fleet epoch
  the journal issued (guarded by ``expected_digest``) on every worker while it is still
  paused, then read every declaration back.
* ``committing`` → **declared** → ``resuming``: the commit point.  The journal records the
  committed workers in the same write as the phase; only now does any worker resume.
  **next_batch** → ``applying`` runs the next batch of a rolling update; **resumed** →
  ``committed`` (every worker) or **resumed_fenced** → ``fenced`` (some were fenced).
* A failure while applying, verifying or committing fires **fail** → ``rolling_back``
  (the policy and quorum decide: under ``fence`` the failed workers are fenced and the rest
  go on while the quorum can be met, or while an earlier batch already committed).
  A rollback pauses every touched worker, restores its last committed weights, re-declares
  its old version under a *new* epoch and reads it back; **rollback_done** →
  ``rolled_back`` when every one of them is back, **rollback_incomplete** →
  ``rollback_failed`` when any is not (it stays paused, reported ``failed``: say a first
  transaction with no source to restore).  Epochs only go up.
* A coordinator that died leaves a non-terminal phase in the journal.  ``recover`` fires
  **recover_abort** from ``preparing`` (a dry run changed nothing), **recover_forward** from
  ``resuming`` (past the commit point: bring every worker onto the committed version and
  go on), **recover_retry** (``fence`` with an earlier batch committed: redo the batch) or
  **recover_rollback** otherwise.  A rollback that was decided stays decided.

Rules of this file:

1. Everything that decides whether a phase change is legal lives in ``TABLE``.
   ``transitions`` builds the machine from it, the diagram in ``docs/fleet.md`` is
   rendered from it, and the tests check it against a hand-written matrix.
2. A trigger with no row for the current phase raises :class:`IllegalState` and changes
   nothing.  Terminal phases (``TERMINAL``) have no outgoing rows.
3. The journal records a phase *before* the coordinator acts on it, so the phase in the
   journal is always the furthest step that may have had an effect.
"""

from __future__ import annotations

from typing import Final

from weightsync.core.errors import IllegalState
from weightsync.core.tables import Row, TableMachine, path, rows, triggers

STATES: Final = (
    "idle",
    "preparing",
    "applying",
    "verifying",
    "committing",
    "resuming",
    "committed",
    "fenced",
    "aborted",
    "rolling_back",
    "rolled_back",
    "rollback_failed",
)
INITIAL: Final = "idle"
TERMINAL: Final = frozenset({"committed", "aborted", "rolled_back", "rollback_failed", "fenced"})

_APPLYING: Final = ("applying", "verifying", "committing")  # weights may have moved

FORWARD: Final = path(
    "idle",
    ("begin", "preparing"),
    ("prepared", "applying"),
    ("applied", "verifying"),
    ("verified", "committing"),
    ("declared", "resuming"),
    ("resumed", "committed"),
)
"""The way forward, one phase after another."""

TABLE: Final[tuple[Row, ...]] = (
    *FORWARD,
    Row("refuse", "preparing", "aborted"),
    Row("next_batch", "resuming", "applying"),  # the next batch of a rolling update
    Row("resumed_fenced", "resuming", "fenced"),
    # failure: back to what the fleet served
    *rows("fail", _APPLYING, "rolling_back"),
    Row("rollback_done", "rolling_back", "rolled_back"),
    Row("rollback_incomplete", "rolling_back", "rollback_failed"),
    # a new coordinator finishing what a dead one left
    Row("recover_abort", "preparing", "aborted"),
    Row("recover_forward", "resuming", "resuming"),
    *rows("recover_retry", _APPLYING, "applying"),
    *rows("recover_rollback", (*_APPLYING, "rolling_back"), "rolling_back"),
)

TRIGGERS: Final = triggers(TABLE)


class TransactionMachine:
    """One transaction's phase.  ``fire`` is the only way to change it."""

    def __init__(self, phase: str = INITIAL) -> None:
        self._machine = TableMachine(TABLE, STATES, phase, what="phase")

    @property
    def phase(self) -> str:
        return self._machine.state

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL

    def fire(self, trigger: str) -> str:
        """Apply ``trigger`` and return the new phase.

        Raises ``IllegalState`` (code ``illegal_phase``, phase unchanged) when the table has
        no row for it, and ``ValueError`` for a trigger the table never names.
        """
        source = self.phase
        if not self._machine.fire(trigger):
            raise IllegalState(
                f"{trigger} is not legal while the transaction is {source}",
                code="illegal_phase",
                state=source,
            ) from None
        return self.phase
