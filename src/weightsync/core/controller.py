"""The async controller: the state machine plus an engine, safe to embed in any server.

Rules it keeps (DESIGN.md §2):

1. Mutating commands run one at a time in arrival order (an ``asyncio.Lock``, which is
   FIFO).  Once a command has arrived it is carried out even if its caller goes away
   (it runs shielded from the caller's cancellation), so arrival order is what happens.
2. Reads (:meth:`Controller.snapshot`) never wait: they see the last committed state and
   ``update_in_flight``.
3. A version is committed only after the engine loaded every tensor and the requested
   prefix-cache reset really happened.
4. Legality is decided by the table in ``_state.py`` *before* the engine is touched, so
   a refused command has no side effect.
5. It keeps the ``name -> hash`` map of the weights the worker holds (from the engine's
   initial hashes, then from the hashes each load reports as the bytes passed through):
   a successful update merges its hashes, a torn one makes every entry unknown, a clean
   refusal changes nothing.  The digest of that map is reported beside the version.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

import attrs

from ._state import REFUSED, SUCCEEDED, TORE, StateMachine, UpdatePlan, check_declare
from .digest import weights_digest
from .engine import (
    AttestingEngine,
    CheckingEngine,
    Engine,
    GroupEngine,
    HashingEngine,
    RpcEngine,
    StampingEngine,
)
from .errors import (
    EngineFailure,
    IllegalState,
    LoadFailed,
    NotFound,
    NotSupported,
    WeightsTorn,
    WeightSyncError,
)
from .requests import InitGroupRequest, PauseRequest, UpdateRequest
from .values import (
    UNDECLARED,
    Declared,
    DryRunOutcome,
    Generation,
    PauseMode,
    PauseOutcome,
    Snapshot,
    UpdateOutcome,
    Verification,
    Version,
    WeightInfo,
)

log = logging.getLogger("weightsync.controller")
T = TypeVar("T")


@attrs.frozen(eq=True, hash=False)
class JournalEntry:
    """One mutating command as it was carried out: arrival number, name, and outcome code."""

    seq: int
    command: str
    outcome: str  # "ok" or the error code
    snapshot: Snapshot


@attrs.frozen
class PauseResult:
    snapshot: Snapshot
    outcome: PauseOutcome
    was_paused: bool


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
    ) -> None:
        self.engine = engine
        self._machine = StateMachine(
            generation="paused" if paused else "running",
            version="declared" if isinstance(version, Declared) else "undeclared",
        )
        self._version: Version = version
        self._lock = asyncio.Lock()
        self._arrivals = itertools.count()
        self._update_in_flight = False
        self._commits = 0
        self._epoch: int | None = None
        # What the worker holds: hashes by name, the names whose content is unknown (written
        # by a torn update), and the digest of the map when it is complete.
        held = engine.initial_hashes() if isinstance(engine, HashingEngine) else None
        self._hashes: dict[str, str] = dict(held or {})
        self._unknown: set[str] = set()
        self._attested = held is not None
        self._digest = self._compute_digest()
        self.journal: deque[JournalEntry] = deque(maxlen=journal_size)
        # Engines that stamp outputs with versions learn each committed state here.
        self._observe: Callable[[Snapshot], None] | None = (
            engine.observe_commit if isinstance(engine, StampingEngine) else None
        )
        self._notify()

    # ------------------------------------------------------------------ reads

    def snapshot(self) -> Snapshot:
        """Return the last committed state; never waits for an in-flight command."""
        return Snapshot(
            version=self._version,
            generation=Generation(self._machine.generation),
            update_in_flight=self._update_in_flight,
            commits=self._commits,
            digest=self._digest,
            epoch=self._epoch,
        )

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
            check_declare(
                digest=self._digest, expected_digest=expected_digest, epoch=self._epoch, new_epoch=epoch
            )
            self._machine.fire("declare")
            self._version = version
            if epoch is not None:
                self._epoch = epoch
            self._commits += 1
            return self.snapshot()

        return await self._serialised("declare", run)

    async def pause(self, request: PauseRequest) -> PauseResult:
        """Pause generation.  Idempotent when already paused (the engine is not called,
        except to clear the cache when ``clear_cache`` asks for it)."""

        async def run() -> PauseResult:
            was_paused = self._machine.generation != "running"
            self._machine.check("pause")
            if was_paused:
                cleared = request.clear_cache and await self._engine_call(self.engine.reset_prefix_cache())
                outcome = PauseOutcome(aborted=0, cache_cleared=cleared)
            else:
                outcome = await self._engine_call(self.engine.pause(request.mode, request.clear_cache))
            self._machine.fire("pause")
            return PauseResult(self.snapshot(), outcome, was_paused)

        return await self._serialised("pause", run)

    async def resume(self) -> Snapshot:
        """Resume generation; refused with code ``weights_torn`` while torn."""

        async def run() -> Snapshot:
            self._machine.check("resume")
            if self._machine.generation != "running":
                await self._engine_call(self.engine.resume())
            self._machine.fire("resume")
            return self.snapshot()

        return await self._serialised("resume", run)

    async def update(self, request: UpdateRequest) -> UpdateOutcome:
        """Load new weights and, on success, commit ``request.version`` if given.

        Raises ``IllegalState`` (nothing done) when running without ``allow_unpaused``;
        the engine's validation error (nothing written) when the source is refused;
        ``WeightsTorn`` when the load failed after writing began or the requested cache
        reset did not happen: the worker is then torn (paused, resume refused) until a
        complete update succeeds.

        Only the engine's ``LoadFailed.wrote`` decides tearing: a failure with
        ``wrote=False`` leaves the state as it was and, on a running worker, never pauses
        or aborts anything.  An exception outside the error family is a breach of the
        engine contract (the engine cannot say what it wrote), so it is treated as
        torn; engines keep it from happening by making ``load_weights`` raise only
        ``LoadFailed`` (the transports' ``load_sync`` is total for that reason).
        """

        if request.dry_run:
            raise ValueError("a dry-run request goes to Controller.dry_run")

        plan = UpdatePlan(declares=request.version is not None)

        async def run() -> UpdateOutcome:
            self._machine.fire_all(plan.begin, allow_unpaused=request.allow_unpaused)
            self._update_in_flight = True
            try:
                return await self._load_and_commit(request, plan)
            finally:
                self._update_in_flight = False

        return await self._serialised("update", run)

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
            self._machine.fire_all(plan.begin)
            hashes = await self._engine_call(engine.check_source(request.source))
            self._machine.fire_all(plan.ending(SUCCEEDED))
            digest = None
            if hashes is not None and self._attested:
                merged = {**self._hashes, **hashes}
                if not (self._unknown - set(hashes)) and len(merged) == len(self._hashes):
                    digest = weights_digest(merged)
            return DryRunOutcome(self.snapshot(), digest)

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
            return Verification(weights_digest(found.hashes), self._digest, found.scope)

        return await self._serialised("verify_weights", run)

    async def flush_cache(self) -> bool:
        """Reset the prefix cache; ``IllegalState`` (``cache_in_use``) when it did not happen."""

        async def run() -> bool:
            if not await self._engine_call(self.engine.reset_prefix_cache()):
                raise IllegalState(
                    "the prefix cache was not reset: running or kept requests hold it; "
                    "pause with mode 'abort' or 'wait' first",
                    code="cache_in_use",
                )
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

    def _group_engine(self) -> GroupEngine:
        if not isinstance(self.engine, GroupEngine):
            raise NotSupported(f"engine {self.engine.name!r} does not support weight-update groups")
        return self.engine

    async def _load_and_commit(self, request: UpdateRequest, plan: UpdatePlan) -> UpdateOutcome:
        try:
            stats = await self.engine.load_weights(request.source)
        except LoadFailed as exc:
            if exc.wrote:
                await self._tear(plan)
                raise WeightsTorn(
                    f"update failed after writing began, worker is torn: {exc.message}",
                    **exc.details,
                ) from exc
            self._machine.fire_all(plan.ending(REFUSED))
            if exc.cause is not None:
                raise exc.cause from exc
            raise
        except WeightSyncError:
            self._machine.fire_all(plan.ending(REFUSED))
            raise
        except BaseException as exc:
            # An engine that broke its contract: we cannot know what was written.
            await self._tear(plan)
            raise WeightsTorn(f"update failed unexpectedly, worker is torn: {exc!r}") from exc

        reset = False
        if request.reset_prefix_cache:
            try:
                reset = await self.engine.reset_prefix_cache()
            except Exception:
                log.exception("prefix cache reset failed")
            if not reset:
                await self._tear(plan)
                raise WeightsTorn(
                    "weights were loaded but the requested prefix-cache reset did not happen, "
                    "so cached prefixes of the old weights may be served; worker is torn — "
                    "pause with mode 'abort' or 'wait' and update again",
                    code="cache_reset_failed",
                )
        self._machine.fire_all(plan.ending(SUCCEEDED))
        self._absorb(stats.hashes, stats.tensors)
        if request.version is not None:
            self._version = request.version
        self._commits += 1
        return UpdateOutcome(self.snapshot(), request.version is not None, reset, stats)

    async def _tear(self, plan: UpdatePlan) -> None:
        if self._machine.generation == "running":
            # Torn implies paused: requests must not go on with weights of no version.
            try:
                await self.engine.pause(PauseMode.ABORT, False)
            except Exception:
                log.exception("could not pause the engine while marking it torn")
        self._machine.fire_all(plan.ending(TORE))
        # Which tensors were written, and with what, is unknown: so is every hash.
        self._unknown = set(self._hashes)
        self._digest = None
        self._commits += 1

    def _absorb(self, hashes: dict[str, str] | None, written: int) -> None:
        """Merge the hashes a successful load reported over the held map."""
        if hashes is None or len(hashes) != written:
            if written:  # tensors changed that nobody hashed: the content is unknown
                self._unknown = set(self._hashes)
        else:
            self._hashes.update(hashes)
            self._unknown -= set(hashes)
        self._digest = self._compute_digest()

    def _compute_digest(self) -> str | None:
        if not self._attested or self._unknown or not self._hashes:
            return None
        return weights_digest(self._hashes)

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

        async def locked() -> T:
            async with self._lock:
                try:
                    result = await run()
                except WeightSyncError as exc:
                    self.journal.append(JournalEntry(seq, name, exc.code, self.snapshot()))
                    self._notify()
                    raise
                self.journal.append(JournalEntry(seq, name, "ok", self.snapshot()))
                self._notify()
                return result

        # Shielded: a caller that disconnects does not cancel a command that has arrived.
        task = asyncio.ensure_future(locked())
        task.add_done_callback(_retrieve)
        return await asyncio.shield(task)


def _retrieve(task: asyncio.Future[Any]) -> None:
    # Mark the outcome as seen even when the caller went away before it arrived.
    if not task.cancelled():
        task.exception()
