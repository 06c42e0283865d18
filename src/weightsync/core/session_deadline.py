"""The open update session's deadline: restarted by every request of the session, and
when it passes, the session is abandoned (DESIGN.md §11)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from weightsync.core.worker_state import Session


class SessionDeadline:
    """Calls ``expire(seq)`` when ``timeout_s`` pass after the last :meth:`arm` for session
    ``seq``, unless :meth:`disarm` (or a later :meth:`arm`) came first."""

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
