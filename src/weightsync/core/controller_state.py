"""What every controller command works on: the committed
:class:`~weightsync.core.worker_state.WorkerState`, the arrival-order queue that runs the
commands, the engine (called through :class:`~weightsync.core.engine_calls.EngineCalls`),
and the one way a load runs and ends.

:class:`~weightsync.core.controller.Controller` is built on it (the update sessions'
commands in :mod:`weightsync.core.update_sessions`, the others in the controller itself).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from weightsync.core.command_queue import CommandQueue
from weightsync.core.engine import Engine, HashingEngine, StampingEngine
from weightsync.core.engine_calls import EngineCalls
from weightsync.core.errors import InvalidRequest
from weightsync.core.requests import UpdateRequest
from weightsync.core.session_deadline import SessionDeadline
from weightsync.core.snapshot import UNDECLARED, JournalEntry, LoadStats, Snapshot, Version
from weightsync.core.sources import DistributedSource
from weightsync.core.worker_state import WorkerState, load_failure

log = logging.getLogger("weightsync.controller")

DEFAULT_SESSION_TIMEOUT_S = 300.0
"""How long an open update session waits for its next request (an update or the finish)
before it is abandoned: five minutes, several times a large model's broadcast."""


class ControllerState:
    """The state, queue and engine of a controller, and the steps its commands share."""

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
        self._deadline = SessionDeadline(session_timeout_s, self._expire)
        self._sessions = itertools.count(1)
        self.engine = engine
        self._engine = EngineCalls(engine)
        self.require_version = require_version
        """Refuse an update that omits ``weight_version`` (``serve --require-version``)."""
        self.dialects: tuple[str, ...] = ("weightsync",)
        """What the server in front of this controller speaks (a dialect server adds its own)."""
        initial = engine.initial_hashes() if isinstance(engine, HashingEngine) else None
        self._state = WorkerState.starting(version=version, paused=paused, hashes=initial)
        self._snapshot: Snapshot | None = None
        self._queue = CommandQueue(journal_size, self.snapshot, self._notify)
        self._dry_runs = asyncio.Lock()  # one dry run's check at a time, outside the queue
        self._checks: set[asyncio.Future[Any]] = set()  # the dry runs' checks under way
        # Engines that stamp outputs with versions learn each committed state here.
        self._observe: Callable[[Snapshot], None] | None = (
            engine.observe_commit if isinstance(engine, StampingEngine) else None
        )
        self._notify()

    @property
    def journal(self) -> deque[JournalEntry]:
        """The last commands' outcomes, in arrival order (``journal_size`` of them)."""
        return self._queue.journal

    def snapshot(self) -> Snapshot:
        """Return the last committed state; never waits for an in-flight command."""
        if self._snapshot is None:  # built once per committed state
            self._snapshot = self._state.snapshot()
        return self._snapshot

    def _expire(self, seq: int) -> None:
        """The deadline of session ``seq`` passed (the session commands abandon it)."""
        raise NotImplementedError

    def _require_version(self, given: bool, fix: str) -> None:
        """Refuse (``version_required``) an update that leaves its version out when this
        worker requires one; ``fix`` says where the caller gives it."""
        if self.require_version and not given:
            raise InvalidRequest(
                f"this worker requires weight_version on every update (serve --require-version){fix}",
                code="version_required",
                field="weight_version",
            )

    async def _load(self, request: UpdateRequest, failed: Callable[[str], Awaitable[None]]) -> LoadStats:
        """Load ``request.source``; on failure commit its ending (``failed``: torn or
        untouched, :func:`~weightsync.core.worker_state.load_failure` decides) and raise."""
        try:
            return await self.engine.load_weights(request.source)
        except BaseException as exc:
            ending, error = load_failure(exc)
            await failed(ending)
            if error is exc:
                raise
            raise error from exc

    def _commit(self, state: WorkerState) -> None:
        self._state = state
        self._snapshot = None

    def _notify(self) -> None:
        if self._observe is not None:
            self._observe(self.snapshot())


def loaded(request: UpdateRequest, stats: LoadStats) -> dict[str, Any]:
    """What a successful load tells the state (the keywords of
    :meth:`~weightsync.core.worker_state.WorkerState.update_ended`): its version, hashes,
    how many tensors it wrote, which ones by name, and whether the engine verified them."""
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
