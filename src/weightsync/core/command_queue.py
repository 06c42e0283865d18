"""The committed worker state, and the one way commands change it: one at a time, in arrival
order, each journalled (DESIGN.md §2, rules 1 and 2).

An ``asyncio.Lock`` is FIFO, so arrival order is the order commands run in.  Each command
runs in a task of its own that its caller's cancellation does not reach: once a command has
arrived it is carried out even if its caller goes away, and its outcome is in the journal.
Reads never wait for the lock: :meth:`CommandQueue.snapshot` is the last committed state.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from weightsync.core.errors import WeightSyncError
from weightsync.core.snapshot import JournalEntry, Snapshot
from weightsync.core.worker_state import WorkerState

T = TypeVar("T")


class CommandQueue:
    """Holds the committed :class:`~weightsync.core.worker_state.WorkerState`, runs commands
    one at a time in arrival order and journals each outcome.

    ``observe``, when given, learns every state the journal records, and the first one here
    (a stamping engine stamps its outputs with the committed version).
    """

    def __init__(
        self, state: WorkerState, journal_size: int, observe: Callable[[Snapshot], None] | None = None
    ) -> None:
        self.journal: deque[JournalEntry] = deque(maxlen=journal_size)
        self._state = state
        self._snapshot: Snapshot | None = None
        self._observe = observe
        self._lock = asyncio.Lock()
        self._arrivals = itertools.count()
        self._running: set[asyncio.Task[None]] = set()
        self._notify()

    @property
    def state(self) -> WorkerState:
        """The last committed state (a command computes its next one from it)."""
        return self._state

    def commit(self, state: WorkerState) -> None:
        """Make ``state`` the committed one (only a command running here calls this)."""
        self._state = state
        self._snapshot = None

    def snapshot(self) -> Snapshot:
        """Return the last committed state; never waits for an in-flight command."""
        if self._snapshot is None:  # built once per committed state
            self._snapshot = self._state.snapshot()
        return self._snapshot

    async def run(self, name: str, command: Callable[[], Awaitable[T]]) -> T:
        """Run ``command`` after every command that arrived before it; return its result or
        raise its exception (a :class:`~weightsync.core.errors.WeightSyncError` is journalled
        under its ``code``)."""
        seq = next(self._arrivals)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        async def locked() -> None:
            async with self._lock:
                try:
                    result = await command()
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

        # The caller waits on ``done``, settled by the task before it ends (one loop step
        # sooner than a shield).
        self.spawn(locked())
        return await done

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task kept alive until it ends (nobody awaits it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _journal(self, seq: int, name: str, outcome: str) -> None:
        self.journal.append(JournalEntry(seq, name, outcome, self.snapshot()))
        self._notify()

    def _notify(self) -> None:
        if self._observe is not None:
            self._observe(self.snapshot())


def _settle(done: asyncio.Future[Any], exc: BaseException) -> None:
    # A caller that went away cancelled ``done``: the outcome is in the journal.
    if not done.cancelled():
        done.set_exception(exc)
