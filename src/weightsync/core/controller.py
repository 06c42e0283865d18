"""The async controller: the state machine plus an engine, safe to embed in any server.

Rules it keeps (DESIGN.md §2):

1. Mutating commands run one at a time in arrival order
   (:class:`~weightsync.core.command_queue.CommandQueue`).  Once a command has arrived it is
   carried out even if its caller goes away, so arrival order is what happens.
2. Reads (:meth:`Controller.snapshot`) never wait: they see the last committed state and
   ``update_in_flight``.
3. A version is committed only after the engine loaded every tensor and the requested
   prefix-cache reset really happened.
4. Legality is decided *before* the engine is touched, so a refused command has no side
   effect: each command computes its next :class:`~weightsync.core.worker_state.WorkerState`
   first (the steps there follow the tables of ``_state.py``), calls the engine, and only
   then commits that state.
5. The weights held (:class:`~weightsync.core.held.HeldWeights`: the engine's initial
   hashes, then the hashes each load reports) are part of that state, and their digest is
   reported beside the version.
6. An update session (:meth:`Controller.begin_session` … :meth:`Controller.finish_session`)
   is abandoned when no request of it arrives within ``session_timeout_s`` of the previous
   one (default :data:`DEFAULT_SESSION_TIMEOUT_S`), or as soon as an update in it fails after
   writing: it then ends as a failed single update does (torn if it wrote, untouched otherwise).

The controller is its parts, called in turn: the committed state and the queue that changes
it (:mod:`~weightsync.core.command_queue`), the calls into the engine, failures mapped to the
error family and optional features (:mod:`~weightsync.core.engine`), and the commands beside
the plain update: the update sessions' with their deadline, the memory release's, and the
settling of a refused update that a trainer already broadcasts (:mod:`~weightsync.core.commands`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

from weightsync.core._state import SUCCEEDED, TORE, UpdateSteps
from weightsync.core.command_queue import CommandQueue
from weightsync.core.commands import (
    DEFAULT_SESSION_TIMEOUT_S,
    MemoryCommands,
    UpdateSessions,
    check_version_given,
    refusing,
)
from weightsync.core.engine import Engine, EngineCalls, HashingEngine, StampingEngine
from weightsync.core.errors import NotFound, cache_reset_failed
from weightsync.core.held import check_not_after, weights_digest
from weightsync.core.requests import (
    FinishSession,
    InitGroupRequest,
    MemoryRequest,
    PauseRequest,
    UpdateRequest,
)
from weightsync.core.snapshot import (
    UNDECLARED,
    Declared,
    DryRunOutcome,
    JournalEntry,
    PauseOutcome,
    PauseResult,
    Snapshot,
    UpdateOutcome,
    Verification,
    Version,
    WeightInfo,
)
from weightsync.core.sources import WeightSource
from weightsync.core.worker_state import WorkerState, loaded

__all__ = ["DEFAULT_SESSION_TIMEOUT_S", "Controller"]

log = logging.getLogger("weightsync.controller")


class Controller:
    """Drives an :class:`~weightsync.core.engine.Engine` through the weight-state machine.

    ``version`` and ``paused`` are the state it starts in; ``journal_size`` bounds
    :attr:`journal`; ``require_version`` refuses updates without a version;
    ``session_timeout_s`` is the update session's deadline; ``clock`` the worker's wall clock
    (unix seconds: what ``not_after`` is checked against; a test's, to run one off).  Every
    mutating method raises the :mod:`~weightsync.core.errors` family and leaves the state
    unchanged when it refuses; :meth:`update` may instead leave the worker torn, and then
    raises :class:`~weightsync.core.errors.WeightsTorn`.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        version: Version = UNDECLARED,
        paused: bool = False,
        journal_size: int = 1024,
        require_version: bool = False,
        session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.require_version = require_version
        """Refuse an update that omits ``weight_version`` (``serve --require-version``)."""
        self.dialects: tuple[str, ...] = ("weightsync",)
        """What the server in front of this controller speaks (a dialect server adds its own)."""
        initial = engine.initial_hashes() if isinstance(engine, HashingEngine) else None
        # Engines that stamp outputs with versions learn each committed state.
        observe = engine.observe_commit if isinstance(engine, StampingEngine) else None
        start = WorkerState.starting(version=version, paused=paused, hashes=initial)
        self._queue = CommandQueue(start, journal_size, observe)
        self._engine = EngineCalls(engine)
        self._sessions = UpdateSessions(self._queue, self._engine, session_timeout_s)
        self._memory = MemoryCommands(self._queue, self._engine)

    # ------------------------------------------------------------------ reads

    @property
    def journal(self) -> deque[JournalEntry]:
        """The last commands' outcomes, in arrival order (``journal_size`` of them)."""
        return self._queue.journal

    @property
    def session_timeout_s(self) -> float:
        """How long an open update session waits for its next request."""
        return self._sessions.timeout_s

    def snapshot(self) -> Snapshot:
        """Return the last committed state; never waits for an in-flight command."""
        return self._queue.snapshot()

    def capabilities(self) -> dict[str, Any]:
        """What this worker speaks and supports (:meth:`EngineCalls.capabilities
        <weightsync.core.engine.EngineCalls.capabilities>`), with the dialects its
        server answers (:attr:`dialects`) and the update session's deadline."""
        held, deadline = self._queue.state.held, self.session_timeout_s
        return self._engine.capabilities(
            dialects=self.dialects, digests=held.attested, session_deadline_s=deadline
        )

    async def weight_info(self) -> WeightInfo:
        """The engine's description of the weights it serves (names, shapes, dtypes)."""
        return await self._engine.call(self.engine.weight_info())

    async def is_alive(self) -> bool:
        """Whether the engine answers its liveness check (a failing check is ``False``)."""
        try:
            return await self.engine.is_alive()
        except Exception:
            log.exception("liveness check failed")
            return False

    # ------------------------------------------------------------------ commands

    async def declare(
        self, version: Declared, *, epoch: int | None = None, expected_digest: str | None = None,
        not_after: float | None = None,
    ) -> Snapshot:  # fmt: skip
        """Declare ``version`` (and the fleet ``epoch``, when given).  Never touches the engine;
        legal in every state.  Raises ``IllegalState`` (``digest_mismatch`` / ``stale_epoch``,
        nothing changed) when a guard fails: see :func:`~weightsync.core.held.check_declare`;
        ``commit_expired`` when it runs after ``not_after`` (:func:`~weightsync.core.held.check_not_after`).
        """
        queue = self._queue

        async def run() -> Snapshot:
            check_not_after(not_after, self.clock())  # when it takes effect, not when it arrived
            queue.commit(queue.state.declared(version, epoch=epoch, expected_digest=expected_digest))
            return queue.snapshot()

        return await queue.run("declare", run)

    async def pause(self, request: PauseRequest) -> PauseResult:
        """Pause generation.  Idempotent when already paused (the engine is not called,
        except to clear the cache when ``clear_cache`` asks for it)."""
        queue = self._queue

        async def run() -> PauseResult:
            was_paused = not queue.state.running
            after = queue.state.paused()
            if was_paused:
                cleared = request.clear_cache and await self._engine.cleared()
                outcome = PauseOutcome(aborted=0, cache_cleared=cleared)
            else:
                outcome = await self._engine.call(self.engine.pause(request.mode, request.clear_cache))
            queue.commit(after)
            return PauseResult(queue.snapshot(), outcome, was_paused)

        return await queue.run("pause", run)

    async def resume(self) -> Snapshot:
        """Resume generation; refused with code ``weights_torn`` while torn."""
        queue = self._queue

        async def run() -> Snapshot:
            after = queue.state.resumed()
            if not queue.state.running:
                await self._engine.call(self.engine.resume())
            queue.commit(after)
            return queue.snapshot()

        return await queue.run("resume", run)

    async def update(self, request: UpdateRequest) -> UpdateOutcome:
        """Load new weights and, on success, commit ``request.version`` if given.

        Raises ``IllegalState`` (nothing done) when running without ``allow_unpaused``;
        the engine's validation error (nothing written) when the source is refused;
        ``WeightsTorn`` when the load failed after writing began or the requested cache
        reset did not happen: the worker is then torn (paused, resume refused) until a
        complete update succeeds.  Which failure tears is
        :func:`~weightsync.core.worker_state.load_failure`'s decision (only
        ``LoadFailed.wrote``, or an exception outside the family, tears).  An update with
        ``session`` streams into the open session instead
        (:meth:`UpdateSessions.update <weightsync.core.commands.UpdateSessions.update>`).
        A refusal here (``not_paused``, ``version_required``) first settles what the source
        owes a trainer that is already broadcasting, in this turn
        (:func:`~weightsync.core.commands.refusing`).
        """

        if request.dry_run:
            raise ValueError("a dry-run request goes to Controller.dry_run")
        if request.session:  # its version, if any, is the finish's business
            return await self._sessions.update(request)
        queue = self._queue
        steps = UpdateSteps(declares=request.version is not None)

        async def failed(ending: str) -> None:
            # A worker that tears while running is paused first (torn implies paused:
            # requests must not go on with weights of no version).
            if ending == TORE and queue.state.running:
                await self._engine.pause_torn()
            queue.commit(queue.state.update_ended(steps, ending))

        async def run() -> UpdateOutcome:
            async with refusing(self._engine, request.source):  # a trainer may be sending already
                check_version_given(
                    self.require_version,
                    request.version is not None,
                    ", so that its label always describes the weights it holds: add weight_version",
                )
                queue.commit(queue.state.update_begun(steps, allow_unpaused=request.allow_unpaused))
            stats = await self._engine.load(queue.state.against_held(request.source), failed)
            reset = False
            if request.reset_prefix_cache:
                reset = await self._engine.cleared_or_logged()
                if not reset:
                    await failed(TORE)
                    raise cache_reset_failed()
            queue.commit(
                queue.state.update_ended(
                    steps, SUCCEEDED, in_place=stats.hashed_in_place, **loaded(request, stats)
                )
            )
            return UpdateOutcome(queue.snapshot(), request.version is not None, reset, stats)

        return await queue.run("update", run)

    async def settle_refused(self, debt: WeightSource | str | None) -> None:
        """Settle, in turn with the commands, what an update refused before it reached the
        controller (its body did not parse) owes a trainer that is already broadcasting:
        ``debt`` is its stream, or its group when the stream did not parse
        (:func:`~weightsync.core.routes.declared_stream`; :meth:`EngineCalls.settle
        <weightsync.core.engine.EngineCalls.settle>`).  Never raises."""
        if debt is not None:
            await self._queue.run("settle_refused", lambda: self._engine.settle(debt))

    # ------------------------------------------------------------------ memory

    async def release_memory(self, request: MemoryRequest) -> Snapshot:
        """Release the engine's memory as ``request`` says (paused or torn; see
        :meth:`MemoryCommands.release <weightsync.core.commands.MemoryCommands.release>`)."""
        return await self._memory.release(request)

    async def restore_memory(self, request: MemoryRequest) -> Snapshot:
        """Restore what ``request`` names (see :meth:`MemoryCommands.restore
        <weightsync.core.commands.MemoryCommands.restore>`)."""
        return await self._memory.restore(request)

    # ------------------------------------------------------------------ update sessions

    async def begin_session(self) -> Snapshot:
        """Open an update session (paused or torn).  Raises ``IllegalState``: ``not_paused``
        while running, ``session_open`` while one is open.  Nothing touches the engine."""
        return await self._sessions.begin()

    async def finish_session(self, request: FinishSession) -> UpdateOutcome:
        """Finish the open session: reset the prefix cache (when asked), then commit the
        weights and the version (the finish's, else the last one an update in the session
        carried) — the only way from a session to a committed version.

        Raises ``IllegalState``: ``no_session``; ``weights_torn`` for a session that began
        torn and wrote nothing.  ``WeightsTorn`` (``cache_reset_failed``) when the requested
        reset did not happen: the session ends torn."""
        return await self._sessions.finish(request, require_version=self.require_version)

    async def abandon_session(self) -> Snapshot:
        """End the open session without committing: torn if it wrote (or began torn), paused
        and untouched otherwise.  Raises ``IllegalState`` (``no_session``)."""
        return await self._sessions.abandon()

    # ------------------------------------------------------------------ checks

    async def dry_run(self, request: UpdateRequest) -> DryRunOutcome:
        """Validate ``request.source`` as an update would, write nothing, change no state.

        Legal in every state (the table's ``dry_run`` rows).  Returns the digest the worker
        would hold after applying the source: the source's declared hashes merged over the
        last committed map, or ``None`` when either is unknown.  Raises the refusal the
        update would raise before its first write; ``NotSupported`` when the engine cannot
        check a source without loading it.

        Not serialised with the mutating commands (and not in :attr:`journal`): it changes
        no state, and checking a checkpoint reads every byte of it, which must not hold up
        a pause, a declare or an update that arrives meanwhile.  Dry runs are serialised
        among themselves instead (:meth:`EngineCalls.check_source
        <weightsync.core.engine.EngineCalls.check_source>`).  The engine's check
        touches no weights; what it leaves (the facts a later update reuses) is re-checked
        by that update against the files.
        """
        self._queue.state.update_begun(UpdateSteps(dry_run=True))  # legality (every state allows it)
        hashes = await self._engine.check_source(self._queue.state.against_held(request.source))
        return DryRunOutcome(self.snapshot(), self._queue.state.held.digest_after(hashes))

    async def verify_weights(self, *, allow_load_digest: bool = False) -> Verification:
        """Hash the weights the engine actually serves and compare with the recorded digest.

        ``allow_load_digest``: when the last load hashed every served tensor in the served
        memory itself, after writing it, and no step that can write weights ran since (the
        held weights are ``in_place``), report that digest (scope ``"load_in_place"``)
        instead of hashing them all again.  It is the digest of what is served unless
        something wrote the weights behind the control plane since that load, which only
        the full re-hash (the default) can see.

        Serialised with updates, so it never sees a load half done.  Raises
        ``NotSupported`` when the engine cannot attest its weights.
        """
        engine = self._engine.attesting()
        queue = self._queue

        async def run() -> Verification:
            held = queue.state.held
            if allow_load_digest and held.in_place_digest is not None:
                return Verification(held.in_place_digest, held.digest, "load_in_place")
            found = await self._engine.call(engine.attest())
            return Verification(
                weights_digest(found.hashes), queue.state.held.digest, found.scope, found.hashes
            )

        return await queue.run("verify_weights", run)

    # ------------------------------------------------------------------ engine features

    async def flush_cache(self) -> bool:
        """Reset the prefix cache; ``CacheInUse`` (``cache_in_use``) when it did not happen."""

        async def run() -> bool:
            await self._engine.reset_cache()
            return True

        return await self._queue.run("flush_cache", run)

    async def abort_request(self, request_id: str) -> None:
        """Abort one in-flight request.  Not serialised: it does not touch weight state."""
        if not await self._engine.call(self.engine.abort_request(request_id)):
            raise NotFound(f"no request {request_id!r} is in flight", code="unknown_request")

    async def init_group(self, request: InitGroupRequest) -> None:
        """Join the weight-update group ``request`` names (``NotSupported`` without groups).
        Not serialised: a join touches no weight state but may wait on a trainer for its whole
        ``timeout_s``; the engine reserves the name meanwhile and :meth:`destroy_group` cancels it."""
        await self._engine.group().init_group(request)

    async def destroy_group(self, group_name: str) -> None:
        """Leave the weight-update group ``group_name`` (``NotSupported`` without groups)."""
        engine = self._engine.group()

        async def run() -> None:
            await engine.destroy_group(group_name)

        await self._queue.run("destroy_group", run)

    @property
    def rpc_methods(self) -> Collection[str]:
        """The engine's allow-listed rpc methods (none for an engine without rpc)."""
        return self._engine.rpc_methods

    async def rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call an allow-listed engine method (parsing already checked the allow-list)."""
        return await self._engine.rpc(method, args, kwargs)
