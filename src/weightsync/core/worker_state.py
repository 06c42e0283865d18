"""The worker's committed state as one frozen value, and the pure steps that move it.

This is where the choreography of every command lives, beside the tables of ``_state.py``
that decide its legality: a step takes the inputs of a command (and, for an update, what
the engine reported) and returns the next :class:`WorkerState`, or raises
:class:`~weightsync.core.errors.IllegalState` and leaves nothing changed (the value is
frozen).  The controller does the I/O around the steps: it takes the lock, computes the
next state *before* calling the engine (so a refusal has no side effect), calls the
engine, and then commits the state the step returned (etcd raft's ``Step``/``Advance``).

An update is ``update_begun`` (``begin_update``: legal only while paused, or running with
``allow_unpaused``) and then exactly one :meth:`WorkerState.update_ended` with the ending
of :data:`~weightsync.core._state.ENDINGS`:

* ``succeeded`` — every tensor is in place and the requested cache reset happened: the
  reported hashes are merged over the held map, and a version given with the update is
  declared (``update_succeeded`` then ``declare``);
* ``tore`` — it failed after writing began: the worker is torn and every hash unknown;
* ``refused`` — it failed before the first write: only ``update_in_flight`` changes.

A dry run fires its own row (legal everywhere) and moves nothing.  Memory commands (``memory_released``,
``memory_restored``) move the memory parts the held weights carry; an update that rewrote every
discarded tensor restores them.

An update session (:class:`~weightsync.core._state.SessionSteps`) is :meth:`WorkerState.session_begun`,
any number of :meth:`WorkerState.session_update_begun` / :meth:`WorkerState.session_update_ended`,
and one :meth:`WorkerState.session_finished` or :meth:`WorkerState.session_abandoned`; what it
wrote so far is a frozen :class:`Session` in the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from weightsync.core._state import REFUSED, TORE, MemorySteps, SessionSteps, UpdateSteps, moved
from weightsync.core.errors import LoadFailed, WeightsTorn, WeightSyncError
from weightsync.core.held import HeldWeights, check_declare
from weightsync.core.requests import UpdateRequest
from weightsync.core.snapshot import UNDECLARED, Declared, Generation, LoadStats, Snapshot, Version
from weightsync.core.sources import DeltaSource, DeltaStreamSource, DistributedSource, HeldBase, WeightSource

_GENERATIONS: Final = {g.value: g for g in Generation}
_NOTHING_HELD: Final = HeldWeights()


@attrs.frozen(eq=True, hash=False)
class Session:
    """An open update session: its number, what its updates wrote (``hashes``, or
    ``unhashed`` when a written tensor went unhashed), the names whose bytes no sender's hash
    checked, and the last version an update inside it carried."""

    seq: int
    wrote: bool = False
    hashes: Mapping[str, str] = attrs.field(factory=dict)
    unhashed: bool = False
    verified: frozenset[str] = frozenset()
    unverified: frozenset[str] = frozenset()
    version: Declared | None = None
    tensors: int = 0
    bytes: int = 0

    def after_update(
        self,
        *,
        hashes: Mapping[str, str] | None,
        written: int,
        nbytes: int,
        names: frozenset[str],
        verified: bool,
        version: Declared | None,
    ) -> Session:
        complete = hashes is not None and len(hashes) == written
        return Session(
            self.seq,
            self.wrote or written > 0,
            {**self.hashes, **(hashes or {})} if complete else self.hashes,
            self.unhashed or (written > 0 and not complete),
            (self.verified | names) if verified else (self.verified - names),
            (self.unverified - names) if verified else (self.unverified | names),
            self.version if version is None else version,
            self.tensors + written,
            self.bytes + nbytes,
        )


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
    session: Session | None = None
    unverified: frozenset[str] = frozenset()
    """Held tensors whose bytes no sender's hash checked (a bare stream without ``hashes``)."""

    @classmethod
    def starting(cls, *, version: Version, paused: bool, hashes: Mapping[str, str] | None) -> WorkerState:
        """A worker's first state: ``hashes`` of the weights it starts with (``None``: unknown)."""
        generation = Generation.PAUSED if paused else Generation.RUNNING
        held = HeldWeights.starting_with(hashes)
        declared = isinstance(version, Declared)
        return cls(generation, version, held, 0, None, False, held.digest if declared else None, declared)

    def against_held(self, source: WeightSource) -> WeightSource:
        """``source``; a delta also learns what its base is checked against: the digest held,
        and the version while its label describes these weights (none inside a session that
        already wrote: nothing of it is committed)."""
        if not isinstance(source, (DeltaSource, DeltaStreamSource)):
            return source
        if self.session is not None and self.session.wrote:
            return attrs.evolve(source, held=HeldBase(None))
        current = isinstance(self.version, Declared) and self.label_current
        version = self.version.value if isinstance(self.version, Declared) and current else None
        return attrs.evolve(source, held=HeldBase(self.held.digest, version, current))

    @property
    def running(self) -> bool:
        return self.generation is Generation.RUNNING

    def snapshot(self) -> Snapshot:
        """The state as every read reports it.  Once an open session wrote, the weights held
        are neither the old ones nor yet the session's: the digest is unknown and the label
        describes nothing until the session ends."""
        wrote = self.session is not None and self.session.wrote
        held = self.held
        return Snapshot(
            self.version, self.generation, self.update_in_flight, self.commits,
            None if wrote else held.digest, self.epoch, self.label_digest,
            self.label_current and not wrote and held.weights != "discarded", verified=not self.unverified,
            weights=held.weights, kv_cache=held.kv_cache,
        )  # fmt: skip

    def _states(self, triggers: tuple[str, ...], **flags: bool) -> dict[str, str]:
        """Every part's state after ``triggers`` (each looked up in the tables, in order).
        Raises ``IllegalState`` at the first one the tables refuse."""
        version = "declared" if isinstance(self.version, Declared) else "undeclared"
        states = {"generation": self.generation.value, "version": version}
        states.update(weights=self.held.weights, kv_cache=self.held.kv_cache)
        for trigger in triggers:
            states = moved(trigger, states, **flags)
        return states

    def _after(self, triggers: tuple[str, ...], **flags: bool) -> Generation:
        """The generation after ``triggers`` (:meth:`_states`)."""
        return _GENERATIONS[self._states(triggers, **flags)["generation"]]

    def _moved(self, generation: Generation, *, update_in_flight: bool | None = None) -> WorkerState:
        # Built field by field: ``attrs.evolve`` costs more than the rest of a command.
        in_flight = self.update_in_flight if update_in_flight is None else update_in_flight
        return WorkerState(
            generation, self.version, self.held, self.commits, self.epoch, in_flight,
            self.label_digest, self.label_current, self.session, self.unverified,
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
            self.held.digest, True, self.session, self.unverified,
        )  # fmt: skip

    def paused(self) -> WorkerState:
        """After ``pause`` (idempotent when paused; a torn worker stays torn)."""
        return self._moved(self._after(("pause",)))

    def resumed(self) -> WorkerState:
        """After ``resume``.  Raises ``IllegalState`` (``weights_torn``) while torn."""
        return self._moved(self._after(("resume",)))

    def update_begun(self, steps: UpdateSteps, *, allow_unpaused: bool = False) -> WorkerState:
        """When the update of ``steps`` may start: before the engine is touched.  Raises
        ``IllegalState`` (``not_paused``) while running without ``allow_unpaused``."""
        generation = self._after(steps.begin, allow_unpaused=allow_unpaused)
        return self._moved(generation, update_in_flight=not steps.dry_run)

    def update_ended(
        self,
        steps: UpdateSteps,
        ending: str,
        *,
        version: Declared | None = None,
        hashes: Mapping[str, str] | None = None,
        written: int = 0,
        names: frozenset[str] = frozenset(),
        verified: bool = True,
        in_place: bool = False,
    ) -> WorkerState:
        """After the update of ``steps`` (begun on this state) ended with ``ending``.

        On ``succeeded``: ``written`` tensors (``names``) were loaded and ``hashes`` are the
        channel's hashes of them (``in_place``: taken from the served memory after the write,
        see :meth:`HeldWeights.loaded`); ``verified`` says whether their bytes were checked
        against the sender's hashes; ``version``, when given, is declared.  A dry run changes
        nothing.
        """
        if steps.dry_run:
            self._after(steps.ending(ending))
            return self
        if ending == REFUSED:
            return self._moved(self._after(steps.ending(ending)), update_in_flight=False)
        held = (
            self.held.torn()
            if ending == TORE
            else self.held.loaded(hashes, written, in_place=in_place, names=names)
        )
        steps = steps._replace(restores=self.held.weights == "discarded" and not held.missing)
        states = self._states(steps.ending(ending))
        generation = _GENERATIONS[states["generation"]]
        held = held.in_memory(states["weights"], held.kv_cache)
        if version is not None:  # declared with the update: the label is these weights'
            label_digest, current = held.digest, True
        else:  # the label stays (the route contract); it still applies only to the same bytes
            label_digest = self.label_digest
            current = self.label_current and held.digest is not None and held.digest == label_digest
        unverified = self.unverified if ending == TORE else _marked(self.unverified, names, verified)
        return WorkerState(
            generation,
            self.version if version is None else version,
            held,
            self.commits + 1,
            self.epoch,
            False,
            label_digest,
            current and ending != TORE,
            self.session,
            unverified,
        )

    # ------------------------------------------------------------------ update sessions

    def session_begun(self, seq: int) -> WorkerState:
        """After ``begin_session``: session ``seq`` is open.  Raises ``IllegalState``
        (``not_paused`` while running, ``session_open`` while one is open)."""
        generation = self._after(SessionSteps.begin)
        return WorkerState(
            generation, self.version, self.held, self.commits, self.epoch, False,
            self.label_digest, self.label_current, Session(seq), self.unverified,
        )  # fmt: skip

    def session_update_begun(self) -> WorkerState:
        """When an update may stream into the open session.  Raises ``IllegalState``
        (``no_session``)."""
        return self._moved(self._after(("session_update",)), update_in_flight=True)

    def session_update_ended(
        self,
        ending: str,
        *,
        version: Declared | None = None,
        hashes: Mapping[str, str] | None = None,
        written: int = 0,
        nbytes: int = 0,
        names: frozenset[str] = frozenset(),
        verified: bool = True,
    ) -> WorkerState:
        """After an update inside the session (begun on this state) ended with ``ending``:
        ``refused`` changes nothing; ``succeeded`` records what it wrote (its ``version``
        waits for the finish); ``tore`` ends the session torn."""
        session = self.session
        assert session is not None, "session_update_begun first"
        generation = self._after(SessionSteps.update(ending, wrote=written > 0))
        if ending == TORE:
            return WorkerState(
                generation, self.version, self.held.torn(), self.commits + 1, self.epoch, False,
                self.label_digest, False, None, self.unverified,
            )  # fmt: skip
        if ending == REFUSED:
            return self._moved(generation, update_in_flight=False)
        session = session.after_update(
            hashes=hashes, written=written, nbytes=nbytes, names=names, verified=verified, version=version
        )
        held = self.held.written_over() if written else self.held
        return WorkerState(
            generation, self.version, held, self.commits, self.epoch, False,
            self.label_digest, self.label_current, session, self.unverified,
        )  # fmt: skip

    def session_finished(self, version: Declared | None = None) -> WorkerState:
        """After ``finish_session`` (the cache reset it asked for happened): the session's
        weights and version (``version``, else the last one an update in it carried) are
        committed.  Raises ``IllegalState``: ``no_session``; ``weights_torn`` for a session
        that began torn and wrote nothing."""
        session = self.session
        wrote = session is not None and session.wrote
        version = version if version is not None or session is None else session.version
        self._after(SessionSteps.finish(version is not None), wrote=wrote)  # legality first
        assert session is not None
        held, unverified = self.held, self.unverified
        if session.wrote:
            names = session.verified | session.unverified
            hashes = None if session.unhashed else session.hashes
            held = held.loaded(hashes, len(session.hashes) or session.tensors, names=names)
            unverified = (unverified - session.verified) | session.unverified
        restores = self.held.weights == "discarded" and not held.missing
        states = self._states(SessionSteps.finish(version is not None, restores), wrote=wrote)
        generation = _GENERATIONS[states["generation"]]
        held = held.in_memory(states["weights"], held.kv_cache)
        if version is not None:  # committed with the session: the label is these weights'
            label_digest, current = held.digest, True
        else:
            label_digest = self.label_digest
            current = self.label_current and held.digest is not None and held.digest == label_digest
        return WorkerState(
            generation, self.version if version is None else version, held, self.commits + 1, self.epoch,
            False, label_digest, current, None, unverified,
        )  # fmt: skip

    def session_abandoned(self) -> WorkerState:
        """After ``abandon_session``: torn if the weights match no version (it wrote, or
        began torn), paused and untouched otherwise.  Raises ``IllegalState`` (``no_session``)."""
        generation = self._after(SessionSteps.abandon)
        held = self.held.torn() if generation is Generation.TORN else self.held
        current = self.label_current and generation is not Generation.TORN
        return WorkerState(
            generation, self.version, held, self.commits + 1, self.epoch, False,
            self.label_digest, current, None, self.unverified,
        )  # fmt: skip

    # ------------------------------------------------------------------ memory

    def memory_released(self, weights: str | None, kv_cache: bool, names: frozenset[str]) -> WorkerState:
        """After releasing memory (:meth:`MemorySteps.release <weightsync.core._state.MemorySteps.release>`);
        ``names``: every served weight (what a discard frees).  Raises ``IllegalState``:
        ``not_paused`` while running, ``session_open`` while a session is open."""
        states = self._states(MemorySteps.release(weights, kv_cache))
        freed = names if weights == "discard" else frozenset()
        return attrs.evolve(self, held=self.held.in_memory(states["weights"], states["kv_cache"], freed))

    def memory_restored(self, weights: bool, kv_cache: bool) -> WorkerState:
        """After restoring memory: offloaded weights are resident again, discarded ones get
        memory but stay ``discarded`` (nothing is in it), a released KV cache is empty."""
        states = self._states(MemorySteps.restore(weights, kv_cache))
        return attrs.evolve(self, held=self.held.in_memory(states["weights"], states["kv_cache"]))


def _marked(unverified: frozenset[str], names: frozenset[str], verified: bool) -> frozenset[str]:
    return unverified - names if verified else unverified | names


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


def loaded(request: UpdateRequest, stats: LoadStats) -> dict[str, Any]:
    """What a successful load tells the state (the keywords of
    :meth:`WorkerState.update_ended` and :meth:`WorkerState.session_update_ended`): its
    version, hashes, how many tensors it wrote, which ones by name, and whether the engine
    verified them."""
    if isinstance(request.source, DistributedSource):
        names = frozenset(t.name for t in request.source.tensors)
    else:
        names = frozenset(stats.hashes or ())
    return {
        "version": request.version,
        "hashes": stats.hashes,
        "written": stats.tensors,
        "names": names,
        "verified": stats.verified,
    }
