"""The controller's commands beside the plain update, each a part sharing its
:class:`~weightsync.core.command_queue.CommandQueue`: the update session's (DESIGN.md §11),
the memory release's (§14), and how a refusal before the engine settles what a trainer
already broadcasting is owed.

Update sessions: begin, stream updates into it, finish (the only way from a session to a
committed version) or abandon; and its deadline.  A session is abandoned when no request of
it arrives within ``session_timeout_s`` of the previous one (default
:data:`DEFAULT_SESSION_TIMEOUT_S`), or as soon as an update in it fails after writing: it
then ends as a failed single update does (torn if it wrote, untouched otherwise).  Legality
is the tables' (:meth:`~weightsync.core.worker_state.WorkerState.session_begun` and the
steps after it); here the engine is called and the state committed.

Memory release (colocated RL: SGLang's ``release_memory_occupation``, vLLM's sleep): the
engine's memory released around an update and restored; legality is
:meth:`~weightsync.core.worker_state.WorkerState.memory_released` and
:meth:`~weightsync.core.worker_state.WorkerState.memory_restored`.

Refusals (:func:`refusing`): vLLM's, SGLang's, TRL's, OpenRLHF's and Miles' trainers post an
update and broadcast at once, so an update refused before its engine saw it (``not_paused``,
``version_required``, ``no_session``) first has the engine drain what the request declared
(:meth:`EngineCalls.settle <weightsync.core.engine.EngineCalls.settle>`), in its own turn: the
trainer's broadcast returns and the group stays in step.  A refusal the engine's channel
raises, and a failure part-way, the channel settles itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from weightsync.core._state import SUCCEEDED, TORE
from weightsync.core.command_queue import CommandQueue
from weightsync.core.engine import EngineCalls
from weightsync.core.errors import InvalidRequest, WeightSyncError, cache_reset_failed
from weightsync.core.requests import FinishSession, MemoryRequest, UpdateRequest
from weightsync.core.snapshot import LoadStats, Snapshot, UpdateOutcome
from weightsync.core.sources import WeightSource
from weightsync.core.worker_state import Session, loaded

log = logging.getLogger("weightsync.controller")

DEFAULT_SESSION_TIMEOUT_S = 300.0
"""How long an open update session waits for its next request (an update or the finish)
before it is abandoned: five minutes, several times a large model's broadcast."""


class UpdateSessions:
    """The update sessions of one controller: each command runs on ``queue`` (the
    controller's), loads through ``engine``, and (re)starts or stops the deadline of
    ``timeout_s``; a passed deadline abandons the session."""

    def __init__(self, queue: CommandQueue, engine: EngineCalls, timeout_s: float) -> None:
        self._deadline = SessionDeadline(timeout_s, self._expire)
        self._queue = queue
        self._engine = engine
        self._numbers = itertools.count(1)

    @property
    def timeout_s(self) -> float:
        """How long an open update session waits for its next request."""
        return self._deadline.timeout_s

    async def begin(self) -> Snapshot:
        """Open an update session (paused or torn).  Raises ``IllegalState``: ``not_paused``
        while running, ``session_open`` while one is open.  Nothing touches the engine."""
        queue = self._queue

        async def run() -> Snapshot:
            queue.commit(queue.state.session_begun(next(self._numbers)))
            self._deadline.arm(queue.state.session)
            return queue.snapshot()

        return await queue.run("begin_session", run)

    async def update(self, request: UpdateRequest) -> UpdateOutcome:
        """Stream ``request.source`` into the open session (``request.session``): the
        weights change, nothing is committed until :meth:`finish`.  A failure before the
        first write changes nothing (the session stays open); one after it ends the session
        torn (``WeightsTorn``).  Raises ``IllegalState`` (``no_session``), the refused source
        settled first (:func:`refusing`)."""
        queue = self._queue

        async def failed(ending: str) -> None:
            queue.commit(queue.state.session_update_ended(ending))
            self._deadline.arm(None if ending == TORE else queue.state.session)

        async def run() -> UpdateOutcome:
            async with refusing(self._engine, request.source):  # a trainer may be sending already
                queue.commit(queue.state.session_update_begun())
            stats = await self._engine.load(queue.state.against_held(request.source), failed)
            queue.commit(
                queue.state.session_update_ended(SUCCEEDED, nbytes=stats.bytes, **loaded(request, stats))
            )
            self._deadline.arm(queue.state.session)
            return UpdateOutcome(queue.snapshot(), False, False, stats)

        return await queue.run("session_update", run)

    async def finish(self, request: FinishSession, *, require_version: bool) -> UpdateOutcome:
        """Finish the open session: reset the prefix cache (when asked), then commit the
        weights and the version (the finish's, else the last one an update in the session
        carried) — the only way from a session to a committed version.

        Raises ``IllegalState``: ``no_session``; ``weights_torn`` for a session that began
        torn and wrote nothing.  ``InvalidRequest`` (``version_required``) when
        ``require_version`` and no version was given.  ``WeightsTorn``
        (``cache_reset_failed``) when the requested reset did not happen: the session ends
        torn."""
        queue = self._queue

        async def run() -> UpdateOutcome:
            after = queue.state.session_finished(request.version)  # legality before anything
            session = queue.state.session
            assert session is not None
            given = request.version is not None or session.version is not None
            check_version_given(require_version, given, ": give it to the finish")
            reset = False
            if request.reset_prefix_cache:
                reset = await self._engine.cleared_or_logged()
                if not reset:
                    queue.commit(queue.state.session_update_ended(TORE))
                    self._deadline.disarm()
                    raise cache_reset_failed()
            queue.commit(after)
            self._deadline.disarm()
            stats = LoadStats(tensors=session.tensors, bytes=session.bytes)
            return UpdateOutcome(queue.snapshot(), given, reset, stats)

        return await queue.run("finish_session", run)

    async def abandon(self) -> Snapshot:
        """End the open session without committing: torn if it wrote (or began torn), paused
        and untouched otherwise.  Raises ``IllegalState`` (``no_session``)."""
        queue = self._queue

        async def run() -> Snapshot:
            queue.commit(queue.state.session_abandoned())
            self._deadline.disarm()
            return queue.snapshot()

        return await queue.run("abandon_session", run)

    def _expire(self, seq: int) -> None:
        """The deadline passed: abandon session ``seq`` unless it already ended."""
        queue = self._queue

        async def run() -> None:
            session = queue.state.session
            if session is not None and session.seq == seq:
                log.warning("update session %d abandoned: nothing arrived for %ss", seq, self.timeout_s)
                queue.commit(queue.state.session_abandoned())
                self._deadline.disarm()

        queue.spawn(queue.run("session_expired", run))


class SessionDeadline:
    """Calls ``expire(seq)`` when ``timeout_s`` pass after the last :meth:`arm` for session
    ``seq``, unless :meth:`disarm` (or a later :meth:`arm`) came first: every request of the
    session restarts it."""

    def __init__(self, timeout_s: float, expire: Callable[[int], None]) -> None:
        if not timeout_s > 0:
            raise ValueError("session_timeout_s must be positive")
        self.timeout_s = float(timeout_s)
        self._expire = expire
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, session: Session | None) -> None:
        """(Re)start the deadline of ``session`` (none: only stop the running one)."""
        self.disarm()
        if session is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.timeout_s, self._expire, session.seq)

    def disarm(self) -> None:
        """Stop the deadline (the session ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def check_version_given(required: bool, given: bool, fix: str) -> None:
    """Refuse (``InvalidRequest``, ``version_required``) an update that leaves its version
    out when this worker requires one (``serve --require-version``); ``fix`` says where the
    caller gives it."""
    if required and not given:
        raise InvalidRequest(
            f"this worker requires weight_version on every update (serve --require-version){fix}",
            code="version_required",
            field="weight_version",
        )


@asynccontextmanager
async def refusing(engine: EngineCalls, source: WeightSource) -> AsyncIterator[None]:
    """Around the checks of an update before ``engine`` is asked to load ``source``: a refusal
    raised inside first settles what ``source`` owes a trainer already broadcasting
    (:meth:`EngineCalls.settle <weightsync.core.engine.EngineCalls.settle>`), in the command's turn."""
    try:
        yield
    except WeightSyncError:
        await engine.settle(source)
        raise


class MemoryCommands:
    """The memory commands of one controller: each runs on ``queue`` (the controller's) and
    calls ``engine``'s :class:`~weightsync.core.engine.MemoryEngine` side."""

    def __init__(self, queue: CommandQueue, engine: EngineCalls) -> None:
        self._queue = queue
        self._engine = engine

    async def release(self, request: MemoryRequest) -> Snapshot:
        """Release the engine's memory as ``request`` says (paused or torn).  Raises
        ``IllegalState`` (nothing done): ``not_paused`` while running, ``session_open`` in a
        session; ``NotSupported`` for an engine that cannot.  Discarded weights are held by
        nobody: resume is refused and the digest unknown until an update rewrote them all."""
        engine = self._engine.memory()
        queue = self._queue

        async def run() -> Snapshot:
            queue.state.memory_released(request.weights, request.kv_cache, frozenset())  # legality first
            info = await self._engine.call(self._engine.engine.weight_info())
            after = queue.state.memory_released(
                request.weights, request.kv_cache, frozenset(t.name for t in info.tensors)
            )
            try:
                await self._engine.call(engine.release_memory(request.weights, request.kv_cache))
            except BaseException:
                if request.weights == "discard":  # freed part-way: the weights are nobody's
                    queue.commit(after)
                raise
            queue.commit(after)
            return queue.snapshot()

        return await queue.run("release_memory", run)

    async def restore(self, request: MemoryRequest) -> Snapshot:
        """Restore what ``request`` names: offloaded weights as they were, discarded ones as
        memory holding nothing (still ``discarded``), the KV cache empty.  Legal in every state;
        ``NotSupported`` for an engine that cannot release memory."""
        engine = self._engine.memory()
        queue = self._queue

        async def run() -> Snapshot:
            after = queue.state.memory_restored(request.weights is not None, request.kv_cache)
            await self._engine.call(engine.restore_memory(request.weights is not None, request.kv_cache))
            queue.commit(after)
            return queue.snapshot()

        return await queue.run("restore_memory", run)
