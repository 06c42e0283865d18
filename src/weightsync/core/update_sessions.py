"""The update session's commands (DESIGN.md §11): begin, stream updates into it, finish
(the only way from a session to a committed version) or abandon.

A session is abandoned when no request of it arrives within ``session_timeout_s`` of the
previous one (default
:data:`~weightsync.core.controller_state.DEFAULT_SESSION_TIMEOUT_S`), or as soon as an
update in it fails after writing: it then ends as a failed single update does (torn if it
wrote, untouched otherwise).  Legality is the tables'
(:meth:`~weightsync.core.worker_state.WorkerState.session_begun` and the steps after it);
here the engine is called and the state committed.
"""

from __future__ import annotations

import logging

from weightsync.core._state import SUCCEEDED, TORE
from weightsync.core.controller_state import ControllerState, loaded
from weightsync.core.requests import FinishSession, UpdateRequest
from weightsync.core.snapshot import LoadStats, Snapshot, UpdateOutcome
from weightsync.core.worker_state import cache_reset_failed

log = logging.getLogger("weightsync.controller")


class UpdateSessions(ControllerState):
    """The session commands of a :class:`~weightsync.core.controller.Controller`."""

    @property
    def session_timeout_s(self) -> float:
        """How long an open update session waits for its next request."""
        return self._deadline.timeout_s

    async def begin_session(self) -> Snapshot:
        """Open an update session (paused or torn).  Raises ``IllegalState``: ``not_paused``
        while running, ``session_open`` while one is open.  Nothing touches the engine."""

        async def run() -> Snapshot:
            self._commit(self._state.session_begun(next(self._sessions)))
            self._deadline.arm(self._state.session)
            return self.snapshot()

        return await self._queue.run("begin_session", run)

    async def _session_update(self, request: UpdateRequest) -> UpdateOutcome:
        """Stream ``request.source`` into the open session (``request.session``): the
        weights change, nothing is committed until :meth:`finish_session`.  A failure before
        the first write changes nothing (the session stays open); one after it ends the
        session torn (``WeightsTorn``).  Raises ``IllegalState`` (``no_session``)."""

        async def failed(ending: str) -> None:
            self._commit(self._state.session_update_ended(ending))
            self._deadline.arm(None if ending == TORE else self._state.session)

        async def run() -> UpdateOutcome:
            self._commit(self._state.session_update_begun())
            stats = await self._load(request, failed)
            self._commit(
                self._state.session_update_ended(SUCCEEDED, nbytes=stats.bytes, **loaded(request, stats))
            )
            self._deadline.arm(self._state.session)
            return UpdateOutcome(self.snapshot(), False, False, stats)

        return await self._queue.run("session_update", run)

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
            given = request.version is not None or session.version is not None
            self._require_version(given, ": give it to the finish")
            reset = False
            if request.reset_prefix_cache:
                reset = await self._engine.cleared_or_logged()
                if not reset:
                    self._commit(self._state.session_update_ended(TORE))
                    self._deadline.disarm()
                    raise cache_reset_failed()
            self._commit(after)
            self._deadline.disarm()
            stats = LoadStats(tensors=session.tensors, bytes=session.bytes)
            declared = request.version is not None or session.version is not None
            return UpdateOutcome(self.snapshot(), declared, reset, stats)

        return await self._queue.run("finish_session", run)

    async def abandon_session(self) -> Snapshot:
        """End the open session without committing: torn if it wrote (or began torn), paused
        and untouched otherwise.  Raises ``IllegalState`` (``no_session``)."""

        async def run() -> Snapshot:
            self._commit(self._state.session_abandoned())
            self._deadline.disarm()
            return self.snapshot()

        return await self._queue.run("abandon_session", run)

    def _expire(self, seq: int) -> None:
        """The deadline passed: abandon session ``seq`` unless it already ended."""

        async def run() -> None:
            session = self._state.session
            if session is not None and session.seq == seq:
                log.warning(
                    "update session %d abandoned: nothing arrived for %ss", seq, self.session_timeout_s
                )
                self._commit(self._state.session_abandoned())
                self._deadline.disarm()

        self._queue.spawn(self._queue.run("session_expired", run))
