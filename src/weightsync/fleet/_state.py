"""The fleet transaction's phases: every legal transition, as data, in this one module.

Theory of operation
-------------------
A fleet transaction moves N workers from one committed version to the next, all or
nothing.  It is a single machine whose state is the transaction's *phase*:

* ``idle`` → **begin** → ``preparing``: every worker dry-runs the update (validates the
  source, writes nothing) and reports the digest it would hold.  Any refusal fires
  **refuse** → ``aborted``: nothing was changed anywhere.
* ``preparing`` → **prepared** → ``applying``: pause (the caller's mode), load, reset the
  prefix cache, on every worker concurrently.
* ``applying`` → **applied** → ``verifying``: every worker's digest must equal the
  expected one.  A label is a claim; the digest is the evidence.
* ``verifying`` → **verified** → ``committing``: declare the version with the next fleet
  epoch (guarded by ``expected_digest``) and resume; **commit_done** → ``committed``.
* Failure while applying, verifying or committing runs the caller's policy:
  **fail** → ``rolling_back`` (workers that loaded go back to their last committed source
  and version; **rollback_done** → ``rolled_back``), or **fence** → ``fencing`` (commit on
  the workers that verified, when at least ``min_workers`` did; **fence_done** →
  ``fenced``).  A fence without its quorum is a rollback.
* A coordinator that died mid-transaction leaves a non-terminal phase in the journal.
  ``recover`` asks every worker for its digest, then fires **recover_commit** →
  ``committing`` when every worker holds the expected weights, **recover_rollback** →
  ``rolling_back`` otherwise, or **recover_abort** → ``aborted`` from ``preparing``
  (a dry run changes nothing, so there is nothing to undo).  A rollback that was decided
  stays decided.

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

from transitions import Machine

from weightsync.core._state import Row, machine_kwargs, try_fire
from weightsync.core.errors import IllegalState

STATES: Final = (
    "idle",
    "preparing",
    "applying",
    "verifying",
    "committing",
    "committed",
    "aborted",
    "rolling_back",
    "rolled_back",
    "fencing",
    "fenced",
)
INITIAL: Final = "idle"
TERMINAL: Final = frozenset({"committed", "aborted", "rolled_back", "fenced"})

TABLE: Final[tuple[Row, ...]] = (
    Row("begin", "idle", "preparing"),
    Row("refuse", "preparing", "aborted"),
    Row("prepared", "preparing", "applying"),
    Row("applied", "applying", "verifying"),
    Row("verified", "verifying", "committing"),
    Row("commit_done", "committing", "committed"),
    Row("fail", "applying", "rolling_back"),
    Row("fail", "verifying", "rolling_back"),
    Row("fail", "committing", "rolling_back"),
    Row("fence", "applying", "fencing"),
    Row("fence", "verifying", "fencing"),
    Row("fence", "committing", "fencing"),
    Row("fence_done", "fencing", "fenced"),
    Row("rollback_done", "rolling_back", "rolled_back"),
    Row("recover_abort", "preparing", "aborted"),
    Row("recover_commit", "applying", "committing"),
    Row("recover_commit", "verifying", "committing"),
    Row("recover_commit", "committing", "committing"),
    Row("recover_commit", "fencing", "committing"),
    Row("recover_rollback", "applying", "rolling_back"),
    Row("recover_rollback", "verifying", "rolling_back"),
    Row("recover_rollback", "committing", "rolling_back"),
    Row("recover_rollback", "fencing", "rolling_back"),
    Row("recover_rollback", "rolling_back", "rolling_back"),
)

TRIGGERS: Final = tuple(dict.fromkeys(r.trigger for r in TABLE))


class _Phase:
    state: str


class TransactionMachine:
    """One transaction's phase.  ``fire`` is the only way to change it."""

    def __init__(self, phase: str = INITIAL) -> None:
        if phase not in STATES:
            raise ValueError(f"unknown phase {phase!r}")
        self._model = _Phase()
        Machine(model=self._model, **machine_kwargs(TABLE, STATES, phase))

    @property
    def phase(self) -> str:
        return self._model.state

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL

    def fire(self, trigger: str) -> str:
        """Apply ``trigger`` and return the new phase.

        Raises ``IllegalState`` (code ``illegal_phase``, phase unchanged) when the table has
        no row for it, and ``ValueError`` for a trigger the table never names.
        """
        if trigger not in TRIGGERS:
            raise ValueError(f"unknown trigger {trigger!r}")
        source = self.phase
        if not try_fire(self._model, trigger):
            raise IllegalState(
                f"{trigger} is not legal while the transaction is {source}",
                code="illegal_phase",
                state=source,
            ) from None
        return self.phase
