"""The worker's committed state as one frozen value, and the pure steps that move it.

This is where the choreography of every command lives, beside the tables of ``_state.py``
that decide its legality: a step takes the inputs of a command (and, for an update, what
the engine reported) and returns the next :class:`WorkerState`, or raises
:class:`~weightsync.core.errors.IllegalState` and leaves nothing changed (the value is
frozen).  The controller does the I/O around the steps: it takes the lock, computes the
next state *before* calling the engine (so a refusal has no side effect), calls the
engine, and then commits the state the step returned — etcd raft's ``Step`` / ``Advance``
split, for one worker.

An update is ``update_begun`` (``begin_update``: legal only while paused, or running with
``allow_unpaused``) and then exactly one :meth:`WorkerState.update_ended` with the ending
of :data:`~weightsync.core._state.ENDINGS`:

* ``succeeded`` — every tensor is in place and the requested cache reset happened: the
  reported hashes are merged over the held map, and a version given with the update is
  declared (``update_succeeded`` then ``declare``);
* ``tore`` — it failed after writing began: the worker is torn and every hash unknown;
* ``refused`` — it failed before the first write: only ``update_in_flight`` changes.

A dry run fires its own row (legal everywhere) and moves nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs

from ._state import REFUSED, TORE, VERSION_TRIGGERS, UpdatePlan, check_declare, move
from .errors import LoadFailed, WeightsTorn, WeightSyncError
from .held import HeldWeights
from .values import UNDECLARED, Declared, Generation, Snapshot, Version

_GENERATIONS: Final = {g.value: g for g in Generation}
_NOTHING_HELD: Final = HeldWeights()


@attrs.frozen(eq=True, hash=False)
class WorkerState:
    """Everything a command can change: the generation, the version (``UNDECLARED`` or
    ``Declared``), the weights held, the count of commits, the fleet epoch, and whether an
    update is in flight.  Built from values the edge already checked: no validators."""

    generation: Generation = Generation.RUNNING
    version: Version = UNDECLARED
    held: HeldWeights = _NOTHING_HELD
    commits: int = 0
    epoch: int | None = None
    update_in_flight: bool = False
    label_digest: str | None = None
    """The digest held when the current label was declared (``None``: unknown or undeclared)."""
    label_current: bool = False
    """Whether the label still describes the weights held: set by every declaration, kept by
    a load without one only while the digest is known and unchanged, cleared by a tear."""

    @classmethod
    def starting(cls, *, version: Version, paused: bool, hashes: Mapping[str, str] | None) -> WorkerState:
        """A worker's first state: ``hashes`` of the weights it starts with (``None``: unknown)."""
        generation = Generation.PAUSED if paused else Generation.RUNNING
        held = HeldWeights.starting_with(hashes)
        declared = isinstance(version, Declared)
        return cls(generation, version, held, 0, None, False, held.digest if declared else None, declared)

    @property
    def running(self) -> bool:
        return self.generation is Generation.RUNNING

    def snapshot(self) -> Snapshot:
        """The state as every read reports it."""
        return Snapshot(
            self.version, self.generation, self.update_in_flight, self.commits, self.held.digest, self.epoch,
            self.label_digest, self.label_current,
        )  # fmt: skip

    def _after(self, triggers: tuple[str, ...], **flags: bool) -> Generation:
        """The generation after ``triggers`` (each looked up in the tables, in order).
        Raises ``IllegalState`` at the first one the tables refuse."""
        generation = self.generation.value
        version = "declared" if isinstance(self.version, Declared) else "undeclared"
        for trigger in triggers:
            if trigger in VERSION_TRIGGERS:
                version = move(trigger, version, **flags)
            else:
                generation = move(trigger, generation, **flags)
        return _GENERATIONS[generation]

    def _moved(self, generation: Generation, *, update_in_flight: bool | None = None) -> WorkerState:
        # Built field by field: ``attrs.evolve`` costs more than the rest of a command.
        in_flight = self.update_in_flight if update_in_flight is None else update_in_flight
        return WorkerState(
            generation, self.version, self.held, self.commits, self.epoch, in_flight,
            self.label_digest, self.label_current,
        )  # fmt: skip

    # ------------------------------------------------------------------ steps

    def declared(
        self, version: Declared, *, epoch: int | None = None, expected_digest: str | None = None
    ) -> WorkerState:
        """After declaring ``version`` (and ``epoch``).  Raises ``IllegalState``
        (``digest_mismatch`` / ``stale_epoch``) when a guard of :func:`check_declare` fails."""
        check_declare(
            digest=self.held.digest, expected_digest=expected_digest, epoch=self.epoch, new_epoch=epoch
        )
        self._after(("declare",))
        epoch = self.epoch if epoch is None else epoch
        return WorkerState(
            self.generation, version, self.held, self.commits + 1, epoch, self.update_in_flight,
            self.held.digest, True,
        )  # fmt: skip

    def paused(self) -> WorkerState:
        """After ``pause`` (idempotent when paused; a torn worker stays torn)."""
        return self._moved(self._after(("pause",)))

    def resumed(self) -> WorkerState:
        """After ``resume``.  Raises ``IllegalState`` (``weights_torn``) while torn."""
        return self._moved(self._after(("resume",)))

    def update_begun(self, plan: UpdatePlan, *, allow_unpaused: bool = False) -> WorkerState:
        """When ``plan``'s update may start: before the engine is touched.  Raises
        ``IllegalState`` (``not_paused``) while running without ``allow_unpaused``."""
        generation = self._after(plan.begin, allow_unpaused=allow_unpaused)
        return self._moved(generation, update_in_flight=not plan.dry_run)

    def update_ended(
        self,
        plan: UpdatePlan,
        ending: str,
        *,
        version: Declared | None = None,
        hashes: Mapping[str, str] | None = None,
        written: int = 0,
    ) -> WorkerState:
        """After ``plan``'s update (begun on this state) ended with ``ending``.

        On ``succeeded``: ``written`` tensors were loaded and ``hashes`` are the channel's
        hashes of them; ``version``, when given, is declared.  A dry run changes nothing.
        """
        generation = self._after(plan.ending(ending))
        if plan.dry_run:
            return self
        if ending == REFUSED:
            return self._moved(generation, update_in_flight=False)
        held = self.held.torn() if ending == TORE else self.held.loaded(hashes, written)
        if version is not None:  # declared with the update: the label is these weights'
            label_digest, current = held.digest, True
        else:  # the label stays (the route contract); it still applies only to the same bytes
            label_digest = self.label_digest
            current = self.label_current and held.digest is not None and held.digest == label_digest
        return WorkerState(
            generation,
            self.version if version is None else version,
            held,
            self.commits + 1,
            self.epoch,
            False,
            label_digest,
            current and ending != TORE,
        )


def load_failure(exc: BaseException) -> tuple[str, BaseException]:
    """How an update whose load raised ``exc`` ends, and the error its caller gets.

    Only :attr:`LoadFailed.wrote <weightsync.core.errors.LoadFailed.wrote>` decides tearing:
    a failure that wrote nothing is ``refused`` (the load's cause, or the family error, is
    raised as it is); one that wrote is ``tore`` (``WeightsTorn``).  An exception outside the
    family breaks the engine contract (the engine cannot say what it wrote): ``tore``.
    """
    if isinstance(exc, LoadFailed):
        if exc.wrote:
            message = f"update failed after writing began, worker is torn: {exc.message}"
            return TORE, WeightsTorn(message, **exc.details)
        return REFUSED, exc.cause if exc.cause is not None else exc
    if isinstance(exc, WeightSyncError):
        return REFUSED, exc
    return TORE, WeightsTorn(f"update failed unexpectedly, worker is torn: {exc!r}")


def cache_reset_failed() -> WeightsTorn:
    """The error of an update whose weights were loaded but whose requested prefix-cache
    reset did not happen: it ends ``tore``."""
    return WeightsTorn(
        "weights were loaded but the requested prefix-cache reset did not happen, "
        "so cached prefixes of the old weights may be served; worker is torn — "
        "pause with mode 'abort' or 'wait' and update again",
        code="cache_reset_failed",
    )
