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
   Its commands are in :mod:`weightsync.core.update_sessions`.

Where the rest lives: the state and the steps every command shares in
:mod:`~weightsync.core.controller_state`, the calls into the engine (failures mapped to the
error family, optional features) in :mod:`~weightsync.core.engine_calls`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from typing import Any

from weightsync.core._state import SUCCEEDED, TORE, UpdatePlan
from weightsync.core.controller_state import DEFAULT_SESSION_TIMEOUT_S, loaded
from weightsync.core.errors import NotFound
from weightsync.core.held import weights_digest
from weightsync.core.requests import InitGroupRequest, PauseRequest, UpdateRequest
from weightsync.core.snapshot import (
    Declared,
    DryRunOutcome,
    PauseOutcome,
    PauseResult,
    Snapshot,
    UpdateOutcome,
    Verification,
    WeightInfo,
)
from weightsync.core.update_sessions import UpdateSessions
from weightsync.core.worker_state import cache_reset_failed

__all__ = ["DEFAULT_SESSION_TIMEOUT_S", "Controller"]

log = logging.getLogger("weightsync.controller")


class Controller(UpdateSessions):
    """Drives an :class:`~weightsync.core.engine.Engine` through the weight-state machine.

    ``version`` and ``paused`` are the state it starts in; ``journal_size`` bounds
    :attr:`journal`; ``require_version`` refuses updates without a version;
    ``session_timeout_s`` is the update session's deadline.  Every mutating method raises
    the :mod:`~weightsync.core.errors` family and leaves the state unchanged when it refuses;
    :meth:`update` may instead leave the worker torn, and then raises
    :class:`~weightsync.core.errors.WeightsTorn`.
    """

    # ------------------------------------------------------------------ reads

    def snapshot(self) -> Snapshot:
        """Return the last committed state; never waits for an in-flight command."""
        if self._snapshot is None:  # built once per committed state
            self._snapshot = self._state.snapshot()
        return self._snapshot

    def capabilities(self) -> dict[str, Any]:
        """What this worker speaks and supports (:meth:`EngineCalls.capabilities
        <weightsync.core.engine_calls.EngineCalls.capabilities>`), with the dialects its
        server answers (:attr:`dialects`) and the update session's deadline."""
        return self._engine.capabilities(
            dialects=self.dialects,
            digests=self._state.held.attested,
            session_deadline_s=self.session_timeout_s,
        )

    async def weight_info(self) -> WeightInfo:
        return await self._engine.call(self.engine.weight_info())

    async def is_alive(self) -> bool:
        try:
            return await self.engine.is_alive()
        except Exception:
            log.exception("liveness check failed")
            return False

    # ------------------------------------------------------------------ commands

    async def declare(
        self, version: Declared, *, epoch: int | None = None, expected_digest: str | None = None
    ) -> Snapshot:
        """Declare ``version`` (and the fleet ``epoch``, when given).  Never touches the engine;
        legal in every state.  Raises ``IllegalState`` (``digest_mismatch`` / ``stale_epoch``,
        nothing changed) when a guard fails: see :func:`~weightsync.core._state.check_declare`.
        """

        async def run() -> Snapshot:
            self._commit(self._state.declared(version, epoch=epoch, expected_digest=expected_digest))
            return self.snapshot()

        return await self._queue.run("declare", run)

    async def pause(self, request: PauseRequest) -> PauseResult:
        """Pause generation.  Idempotent when already paused (the engine is not called,
        except to clear the cache when ``clear_cache`` asks for it)."""

        async def run() -> PauseResult:
            was_paused = not self._state.running
            after = self._state.paused()
            if was_paused:
                cleared = request.clear_cache and await self._engine.cleared()
                outcome = PauseOutcome(aborted=0, cache_cleared=cleared)
            else:
                outcome = await self._engine.call(self.engine.pause(request.mode, request.clear_cache))
            self._commit(after)
            return PauseResult(self.snapshot(), outcome, was_paused)

        return await self._queue.run("pause", run)

    async def resume(self) -> Snapshot:
        """Resume generation; refused with code ``weights_torn`` while torn."""

        async def run() -> Snapshot:
            after = self._state.resumed()
            if not self._state.running:
                await self._engine.call(self.engine.resume())
            self._commit(after)
            return self.snapshot()

        return await self._queue.run("resume", run)

    async def update(self, request: UpdateRequest) -> UpdateOutcome:
        """Load new weights and, on success, commit ``request.version`` if given.

        Raises ``IllegalState`` (nothing done) when running without ``allow_unpaused``;
        the engine's validation error (nothing written) when the source is refused;
        ``WeightsTorn`` when the load failed after writing began or the requested cache
        reset did not happen: the worker is then torn (paused, resume refused) until a
        complete update succeeds.  Which failure tears is
        :func:`~weightsync.core.worker_state.load_failure`'s decision (only
        ``LoadFailed.wrote``, or an exception outside the family, tears).
        """

        if request.dry_run:
            raise ValueError("a dry-run request goes to Controller.dry_run")
        if request.session:  # its version, if any, is the finish's business
            return await self._session_update(request)
        self._require_version(
            request.version is not None,
            ", so that its label always describes the weights it holds: add weight_version",
        )

        plan = UpdatePlan(declares=request.version is not None)

        async def failed(ending: str) -> None:
            # A worker that tears while running is paused first (torn implies paused:
            # requests must not go on with weights of no version).
            if ending == TORE and self._state.running:
                await self._engine.pause_torn()
            self._commit(self._state.update_ended(plan, ending))

        async def run() -> UpdateOutcome:
            self._commit(self._state.update_begun(plan, allow_unpaused=request.allow_unpaused))
            stats = await self._load(request, failed)
            reset = False
            if request.reset_prefix_cache:
                reset = await self._engine.cleared_or_logged()
                if not reset:
                    await failed(TORE)
                    raise cache_reset_failed()
            self._commit(
                self._state.update_ended(
                    plan, SUCCEEDED, in_place=stats.hashed_in_place, **loaded(request, stats)
                )
            )
            return UpdateOutcome(self.snapshot(), request.version is not None, reset, stats)

        return await self._queue.run("update", run)

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
        among themselves instead: one check reads at a time, so many of them cannot fill
        the threads the commands' engine calls run in.  A check whose caller went away
        still holds its turn until it ends (its read goes on in its thread).  The engine's
        check touches no weights; what it leaves (the facts a later update reuses) is
        re-checked by that update against the files.
        """
        engine = self._engine.checking()
        self._state.update_begun(UpdatePlan(dry_run=True))  # legality (every state allows it)

        async def check() -> Mapping[str, str] | None:
            async with self._dry_runs:
                return await self._engine.call(engine.check_source(request.source))

        task = asyncio.ensure_future(check())
        self._checks.add(task)  # kept alive even if its caller goes away
        task.add_done_callback(self._checked)
        hashes = await asyncio.shield(task)
        return DryRunOutcome(self.snapshot(), self._state.held.digest_after(hashes))

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

        async def run() -> Verification:
            held = self._state.held
            if allow_load_digest and held.in_place_digest is not None:
                return Verification(held.in_place_digest, held.digest, "load_in_place")
            found = await self._engine.call(engine.attest())
            return Verification(weights_digest(found.hashes), self._state.held.digest, found.scope)

        return await self._queue.run("verify_weights", run)

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
        engine = self._engine.group()

        async def run() -> None:
            await engine.init_group(request)

        await self._queue.run("init_group", run)

    async def destroy_group(self, group_name: str) -> None:
        engine = self._engine.group()

        async def run() -> None:
            await engine.destroy_group(group_name)

        await self._queue.run("destroy_group", run)

    @property
    def rpc_methods(self) -> Collection[str]:
        return self._engine.rpc_methods

    async def rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call an allow-listed engine method (parsing already checked the allow-list)."""
        return await self._engine.rpc(method, args, kwargs)

    def _checked(self, task: asyncio.Future[Mapping[str, str] | None]) -> None:
        """A dry run's check ended: forget it, and take its outcome (its caller may be gone)."""
        self._checks.discard(task)
        if not task.cancelled():
            task.exception()
