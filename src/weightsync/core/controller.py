"""The async controller: the state machine plus an engine, safe to embed in any server.

Rules it keeps (DESIGN.md §2):

1. Mutating commands run one at a time in arrival order (an ``asyncio.Lock``, which is
   FIFO).  Once a command has arrived it is carried out even if its caller goes away
   (it runs shielded from the caller's cancellation), so arrival order is what happens.
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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

from ._state import SUCCEEDED, TORE, UpdatePlan
from .digest import weights_digest
from .engine import (
    AttestingEngine,
    CheckingEngine,
    Engine,
    GroupEngine,
    HashingEngine,
    ParallelEngine,
    RpcEngine,
    StampingEngine,
)
from .errors import (
    EngineFailure,
    IllegalState,
    InvalidRequest,
    NotFound,
    NotSupported,
    WeightSyncError,
)
from .requests import FinishSession, InitGroupRequest, PauseRequest, UpdateRequest
from .sources import DistributedSource
from .values import (
    UNDECLARED,
    Declared,
    DryRunOutcome,
    JournalEntry,
    LoadStats,
    PauseMode,
    PauseOutcome,
    PauseResult,
    Snapshot,
    UpdateOutcome,
    Verification,
    Version,
    WeightInfo,
)
from .worker_state import WorkerState, cache_reset_failed, load_failure

log = logging.getLogger("weightsync.controller")
T = TypeVar("T")

DEFAULT_SESSION_TIMEOUT_S = 300.0
"""How long an open update session waits for its next request (an update or the finish)
before it is abandoned: five minutes, several times a large model's broadcast."""


class Controller:
    """Drives an :class:`~weightsync.core.engine.Engine` through the weight-state machine.

    Every mutating method raises the :mod:`~weightsync.core.errors` family and leaves the
    state unchanged when it refuses; :meth:`update` may instead leave the worker torn,
    and then raises :class:`~weightsync.core.errors.WeightsTorn`.
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
    ) -> None:
        if not session_timeout_s > 0:
            raise ValueError("session_timeout_s must be positive")
        self.engine = engine
        self.require_version = require_version
        """Refuse an update that omits ``weight_version`` (``serve --require-version``)."""
        self.session_timeout_s = float(session_timeout_s)
        self.dialects: tuple[str, ...] = ("weightsync",)
        """What the server in front of this controller speaks (a dialect server adds its own)."""
        self._sessions = itertools.count(1)
        self._session_timer: asyncio.TimerHandle | None = None
        initial = engine.initial_hashes() if isinstance(engine, HashingEngine) else None
        self._state = WorkerState.starting(version=version, paused=paused, hashes=initial)
        self._snapshot: Snapshot | None = None
        self._lock = asyncio.Lock()
        self._arrivals = itertools.count()
        self._running: set[asyncio.Task[None]] = set()
        self.journal: deque[JournalEntry] = deque(maxlen=journal_size)
        # Engines that stamp outputs with versions learn each committed state here.
        self._observe: Callable[[Snapshot], None] | None = (
            engine.observe_commit if isinstance(engine, StampingEngine) else None
        )
        self._notify()

    # ------------------------------------------------------------------ reads

    def snapshot(self) -> Snapshot:
        """Return the last committed state; never waits for an in-flight command."""
        if self._snapshot is None:  # built once per committed state
            self._snapshot = self._state.snapshot()
        return self._snapshot

    def capabilities(self) -> dict[str, Any]:
        """What this worker speaks and supports, from the engine's optional features: the
        dialects its server answers (:attr:`dialects`), the weight channels, torch.distributed
        backends and streams, pause modes, whether digests are reported, dry runs and
        verification, the engine, its world size and the update session's deadline."""
        engine = self.engine
        groups = isinstance(engine, GroupEngine)
        return {
            "dialects": list(self.dialects),
            "engine": engine.name,
            "world_size": int(engine.world_size) if isinstance(engine, ParallelEngine) else 1,
            "channels": ["disk", *(["distributed"] if groups else []), "tensor"],
            "backends": ["gloo", "nccl"] if groups else [],
            "streams": ["packed", "per_tensor", "flat"] if groups else [],
            "pause_modes": [m.value for m in PauseMode],
            "digests": self._state.held.attested,
            "dry_run": isinstance(engine, CheckingEngine),
            "verify_weights": isinstance(engine, AttestingEngine),
            "session_deadline_s": self.session_timeout_s,
            "vllm_weight_transfer": ["weightsync", "nccl"] if groups else [],
        }

    async def weight_info(self) -> WeightInfo:
        return await self._engine_call(self.engine.weight_info())

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

        return await self._serialised("declare", run)

    async def pause(self, request: PauseRequest) -> PauseResult:
        """Pause generation.  Idempotent when already paused (the engine is not called,
        except to clear the cache when ``clear_cache`` asks for it)."""

        async def run() -> PauseResult:
            was_paused = not self._state.running
            after = self._state.paused()
            if was_paused:
                outcome = PauseOutcome(aborted=0, cache_cleared=request.clear_cache and await self._cleared())
            else:
                outcome = await self._engine_call(self.engine.pause(request.mode, request.clear_cache))
            self._commit(after)
            return PauseResult(self.snapshot(), outcome, was_paused)

        return await self._serialised("pause", run)

    async def resume(self) -> Snapshot:
        """Resume generation; refused with code ``weights_torn`` while torn."""

        async def run() -> Snapshot:
            after = self._state.resumed()
            if not self._state.running:
                await self._engine_call(self.engine.resume())
            self._commit(after)
            return self.snapshot()

        return await self._serialised("resume", run)

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
        if self.require_version and request.version is None:
            raise InvalidRequest(
                "this worker requires weight_version on every update (serve --require-version), so "
                "that its label always describes the weights it holds: add weight_version",
                code="version_required",
                field="weight_version",
            )

        plan = UpdatePlan(declares=request.version is not None)

        async def run() -> UpdateOutcome:
            self._commit(self._state.update_begun(plan, allow_unpaused=request.allow_unpaused))
            return await self._load_and_commit(request, plan)

        return await self._serialised("update", run)

    # ------------------------------------------------------------------ update sessions

    async def begin_session(self) -> Snapshot:
        """Open an update session (paused or torn).  Raises ``IllegalState``: ``not_paused``
        while running, ``session_open`` while one is open.  Nothing touches the engine."""

        async def run() -> Snapshot:
            self._commit(self._state.session_begun(next(self._sessions)))
            self._arm()
            return self.snapshot()

        return await self._serialised("begin_session", run)

    async def _session_update(self, request: UpdateRequest) -> UpdateOutcome:
        """Stream ``request.source`` into the open session (``request.session``): the
        weights change, nothing is committed until :meth:`finish_session`.  A failure before
        the first write changes nothing (the session stays open); one after it ends the
        session torn (``WeightsTorn``).  Raises ``IllegalState`` (``no_session``)."""

        async def run() -> UpdateOutcome:
            before = self._state
            self._commit(before.session_update_begun())
            try:
                stats = await self.engine.load_weights(request.source)
            except BaseException as exc:
                ending, error = load_failure(exc)
                self._commit(self._state.session_update_ended(ending))
                self._disarm() if ending == TORE else self._arm()
                if error is exc:
                    raise
                raise error from exc
            self._commit(
                self._state.session_update_ended(
                    SUCCEEDED,
                    version=request.version,
                    hashes=stats.hashes,
                    written=stats.tensors,
                    nbytes=stats.bytes,
                    names=_names(request, stats),
                    verified=bool(stats.extra.get("verified", True)),
                )
            )
            self._arm()
            return UpdateOutcome(self.snapshot(), False, False, stats)

        return await self._serialised("session_update", run)

    async def finish_session(self, request: FinishSession) -> UpdateOutcome:
        """Finish the open session: reset the prefix cache (when asked), then commit the
        weights and the version (the finish's, else the last one an update in the session
        carried) — the only way from a session to a committed version.

        Raises ``IllegalState``: ``no_session``; ``weights_torn`` for a session that began
        torn and wrote nothing.  ``WeightsTorn`` (``cache_reset_failed``) when the requested
        reset did not happen: the session ends torn."""

        async def run() -> UpdateOutcome:
            after = self._state.session_finished(request.version)  # legality before anything
            session = self._state.session
            assert session is not None
            if self.require_version and request.version is None and session.version is None:
                raise InvalidRequest(
                    "this worker requires weight_version on every update (serve --require-version): "
                    "give it to the finish",
                    code="version_required",
                    field="weight_version",
                )
            reset = False
            if request.reset_prefix_cache:
                try:
                    reset = await self._cleared()
                except Exception:
                    log.exception("prefix cache reset failed")
                if not reset:
                    self._commit(self._state.session_update_ended(TORE))
                    self._disarm()
                    raise cache_reset_failed()
            self._commit(after)
            self._disarm()
            stats = LoadStats(tensors=session.tensors, bytes=session.bytes)
            declared = request.version is not None or session.version is not None
            return UpdateOutcome(self.snapshot(), declared, reset, stats)

        return await self._serialised("finish_session", run)

    async def abandon_session(self) -> Snapshot:
        """End the open session without committing: torn if it wrote (or began torn), paused
        and untouched otherwise.  Raises ``IllegalState`` (``no_session``)."""

        async def run() -> Snapshot:
            self._commit(self._state.session_abandoned())
            self._disarm()
            return self.snapshot()

        return await self._serialised("abandon_session", run)

    def _arm(self) -> None:
        """(Re)start the open session's deadline."""
        self._disarm()
        session = self._state.session
        if session is not None:
            loop = asyncio.get_running_loop()
            self._session_timer = loop.call_later(self.session_timeout_s, self._expire, session.seq)

    def _disarm(self) -> None:
        if self._session_timer is not None:
            self._session_timer.cancel()
            self._session_timer = None

    def _expire(self, seq: int) -> None:
        """The deadline passed: abandon session ``seq`` unless it already ended."""

        async def run() -> None:
            session = self._state.session
            if session is not None and session.seq == seq:
                log.warning(
                    "update session %d abandoned: nothing arrived for %ss", seq, self.session_timeout_s
                )
                self._commit(self._state.session_abandoned())
                self._session_timer = None

        task = asyncio.get_running_loop().create_task(self._serialised("session_expired", run))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def dry_run(self, request: UpdateRequest) -> DryRunOutcome:
        """Validate ``request.source`` as an update would, write nothing, change no state.

        Legal in every state (the table's ``dry_run`` rows).  Returns the digest the worker
        would hold after applying the source: the source's declared hashes merged over the
        current map, or ``None`` when either is unknown.  Raises the refusal the update
        would raise before its first write; ``NotSupported`` when the engine cannot check
        a source without loading it.
        """
        engine = self.engine
        if not isinstance(engine, CheckingEngine):
            raise NotSupported(f"engine {engine.name!r} cannot dry-run an update")
        plan = UpdatePlan(dry_run=True)

        async def run() -> DryRunOutcome:
            self._state.update_begun(plan)
            hashes = await self._engine_call(engine.check_source(request.source))
            return DryRunOutcome(self.snapshot(), self._state.held.digest_after(hashes))

        return await self._serialised("dry_run", run)

    async def verify_weights(self) -> Verification:
        """Hash the weights the engine actually serves and compare with the recorded digest.

        Serialised with updates, so it never sees a load half done.  Raises
        ``NotSupported`` when the engine cannot attest its weights.
        """
        engine = self.engine
        if not isinstance(engine, AttestingEngine):
            raise NotSupported(f"engine {engine.name!r} cannot attest its weights")

        async def run() -> Verification:
            found = await self._engine_call(engine.attest())
            return Verification(weights_digest(found.hashes), self._state.held.digest, found.scope)

        return await self._serialised("verify_weights", run)

    async def flush_cache(self) -> bool:
        """Reset the prefix cache; ``IllegalState`` (``cache_in_use``) when it did not happen."""

        async def run() -> bool:
            await self._reset_cache()
            return True

        return await self._serialised("flush_cache", run)

    async def abort_request(self, request_id: str) -> None:
        """Abort one in-flight request.  Not serialised: it does not touch weight state."""
        if not await self._engine_call(self.engine.abort_request(request_id)):
            raise NotFound(f"no request {request_id!r} is in flight", code="unknown_request")

    async def init_group(self, request: InitGroupRequest) -> None:
        engine = self._group_engine()

        async def run() -> None:
            await engine.init_group(request)

        await self._serialised("init_group", run)

    async def destroy_group(self, group_name: str) -> None:
        engine = self._group_engine()

        async def run() -> None:
            await engine.destroy_group(group_name)

        await self._serialised("destroy_group", run)

    @property
    def rpc_methods(self) -> Collection[str]:
        return tuple(self.engine.rpc_methods) if isinstance(self.engine, RpcEngine) else ()

    async def rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call an allow-listed engine method (parsing already checked the allow-list)."""
        engine = self.engine
        if not isinstance(engine, RpcEngine) or method not in engine.rpc_methods:
            raise NotSupported(f"engine {engine.name!r} has no rpc method {method!r}")
        return await self._engine_call(engine.rpc(method, args, kwargs))

    # ------------------------------------------------------------------ internals

    async def _reset_cache(self) -> None:
        # The one place where an engine's ``False`` (it did not reset) becomes a refusal.
        if not await self._engine_call(self.engine.reset_prefix_cache()):
            raise IllegalState(
                "the prefix cache was not reset: running or kept requests hold it; "
                "pause with mode 'abort' or 'wait' first",
                code="cache_in_use",
            )

    async def _cleared(self) -> bool:
        """Whether a prefix-cache reset happened (inside a pause or an update, where a reset
        that did not happen is a fact to report or to tear on, not a refusal)."""
        try:
            await self._reset_cache()
        except IllegalState:
            return False
        return True

    def _group_engine(self) -> GroupEngine:
        if not isinstance(self.engine, GroupEngine):
            raise NotSupported(f"engine {self.engine.name!r} does not support weight-update groups")
        return self.engine

    async def _load_and_commit(self, request: UpdateRequest, plan: UpdatePlan) -> UpdateOutcome:
        try:
            stats = await self.engine.load_weights(request.source)
        except BaseException as exc:
            ending, error = load_failure(exc)
            await self._end(plan, ending)
            if error is exc:
                raise
            raise error from exc
        reset = False
        if request.reset_prefix_cache:
            try:
                reset = await self._cleared()
            except Exception:
                log.exception("prefix cache reset failed")
            if not reset:
                await self._end(plan, TORE)
                raise cache_reset_failed()
        self._commit(
            self._state.update_ended(
                plan,
                SUCCEEDED,
                version=request.version,
                hashes=stats.hashes,
                written=stats.tensors,
                names=_names(request, stats),
                verified=bool(stats.extra.get("verified", True)),
            )
        )
        return UpdateOutcome(self.snapshot(), request.version is not None, reset, stats)

    async def _end(self, plan: UpdatePlan, ending: str) -> None:
        """Commit a failed update's ``ending``; a worker that tears while running is paused
        first (torn implies paused: requests must not go on with weights of no version)."""
        if ending == TORE and self._state.running:
            try:
                await self.engine.pause(PauseMode.ABORT, False)
            except Exception:
                log.exception("could not pause the engine while marking it torn")
        self._commit(self._state.update_ended(plan, ending))

    def _commit(self, state: WorkerState) -> None:
        self._state = state
        self._snapshot = None

    def _notify(self) -> None:
        if self._observe is not None:
            self._observe(self.snapshot())

    async def _engine_call(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except WeightSyncError:
            raise
        except Exception as exc:
            raise EngineFailure(f"engine {self.engine.name!r} failed: {exc!r}") from exc

    async def _serialised(self, name: str, run: Callable[[], Awaitable[T]]) -> T:
        seq = next(self._arrivals)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        async def locked() -> None:
            async with self._lock:
                try:
                    result = await run()
                except WeightSyncError as exc:
                    self._journal(seq, name, exc.code)
                    _settle(done, exc)
                    return
                except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                    done.cancel()
                    raise
                except BaseException as exc:  # a bug: the caller sees it, as it would inline
                    _settle(done, exc)
                    return
                self._journal(seq, name, "ok")
                if not done.cancelled():
                    done.set_result(result)

        # A task of its own, which the caller's cancellation does not reach: a command that
        # has arrived is carried out even when its caller goes away.  The caller waits on
        # ``done``, settled by the task before it ends (one loop step sooner than a shield).
        task = loop.create_task(locked())
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return await done

    def _journal(self, seq: int, name: str, outcome: str) -> None:
        self.journal.append(JournalEntry(seq, name, outcome, self.snapshot()))
        self._notify()


def _names(request: UpdateRequest, stats: LoadStats) -> frozenset[str]:
    """The tensors an update wrote, by name."""
    if isinstance(request.source, DistributedSource):
        return frozenset(t.name for t in request.source.tensors)
    return frozenset(stats.hashes or ())


def _settle(done: asyncio.Future[Any], exc: BaseException) -> None:
    # A caller that went away cancelled ``done``: the outcome is in the journal.
    if not done.cancelled():
        done.set_exception(exc)
