"""Mutating commands one at a time, in arrival order, each journalled (DESIGN.md §2, rule 1).

An ``asyncio.Lock`` is FIFO, so arrival order is the order commands run in.  Each command
runs in a task of its own that its caller's cancellation does not reach: once a command has
arrived it is carried out even if its caller goes away, and its outcome is in the journal.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from weightsync.core.errors import WeightSyncError
from weightsync.core.snapshot import JournalEntry, Snapshot

T = TypeVar("T")


class CommandQueue:
    """Runs commands one at a time in arrival order and journals each outcome.

    ``snapshot`` gives the state each journal entry records; ``journalled`` is called after
    every entry (the controller tells a stamping engine the committed state there).
    """

    def __init__(
        self, journal_size: int, snapshot: Callable[[], Snapshot], journalled: Callable[[], None]
    ) -> None:
        self.journal: deque[JournalEntry] = deque(maxlen=journal_size)
        self._snapshot = snapshot
        self._journalled = journalled
        self._lock = asyncio.Lock()
        self._arrivals = itertools.count()
        self._running: set[asyncio.Task[None]] = set()

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
        self.journal.append(JournalEntry(seq, name, outcome, self._snapshot()))
        self._journalled()


def _settle(done: asyncio.Future[Any], exc: BaseException) -> None:
    # A caller that went away cancelled ``done``: the outcome is in the journal.
    if not done.cancelled():
        done.set_exception(exc)
