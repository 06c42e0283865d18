"""Declarations in doubt: sent to a worker, answered by nothing, and able to land until they
expire.

One value keeps them for every driver that declares: a transaction (its commit and
rollback phases, and a recovery, which doubts every worker until the journalled expiry)
and the steps outside one (adopt, admission).  Whatever comes next may not be undone by a
late declaration, so each driver waits them out (:meth:`Doubts.settle`) before it records
or reports.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from typing import Any

import attrs

from weightsync.fleet.calls import InDoubt, Note, Step
from weightsync.fleet.events import Emit

__all__ = ["Doubts", "Say", "said"]

Say = Callable[[str | None, str, str], None]
"""Say one thing about a worker (or ``None``: the whole step): ``(worker, what, detail)``."""


def said(phase: str, emit: Emit) -> Say:
    """``emit`` as ``phase``: how a step outside a transaction says things."""
    return lambda worker, what, detail: emit(phase, worker, what, detail)


@attrs.define
class Doubts:
    """Per worker, when the last declaration sent to it that got no answer can no longer
    land (unix seconds, this clock)."""

    until: dict[str, float] = attrs.field(factory=dict)

    @classmethod
    def all_until(cls, urls: Collection[str], until: float) -> Doubts:
        """Every one of ``urls`` in doubt until ``until`` (a recovery: the clock readings of
        the coordinator that sent them died with it)."""
        return cls(dict.fromkeys(urls, until))

    def __contains__(self, url: object) -> bool:
        return url in self.until

    def doubt(self, url: str, until: float) -> None:
        """A declaration sent to ``url`` got no answer: it may land until ``until``."""
        self.until[url] = max(until, self.until.get(url, until))

    def heard(self, step: InDoubt, say: Say) -> None:
        """Keep ``step`` (a script's report of a declaration that got no answer) and say so."""
        self.doubt(step.worker, step.until)
        say(step.worker, "commit in doubt", f"it may land until {step.until:.3f}")

    def unsettled(self, urls: Collection[str] | None = None) -> float:
        """Seconds until no declaration in doubt to ``urls`` (default: any worker) can land."""
        ends = [t for u, t in self.until.items() if urls is None or u in urls]
        return max(0.0, max(ends) - time.time()) if ends else 0.0

    async def settle(self, say: Say, unanswered: str, urls: Collection[str] | None = None) -> None:
        """Wait until no declaration in doubt to ``urls`` (default: any worker) can land,
        having said how long (``unanswered`` names what was sent: a commit, a declaration)."""
        wait = self.unsettled(urls)
        if wait > 0:
            who = ", ".join(u for u in self.until if urls is None or u in urls)
            say(None, "settling", f"{wait:.1f}s until the unanswered {unanswered}(s) to {who} expire")
            await asyncio.sleep(wait)

    def aside(self, phase: str, emit: Emit) -> Callable[[Step], Any]:
        """The aside of a step outside a transaction (adopt, admission), whose scripts make
        calls and notes only: notes and doubts are said as ``phase``."""

        async def aside(step: Step) -> None:
            if isinstance(step, InDoubt):
                self.heard(step, said(phase, emit))
            elif isinstance(step, Note):
                emit(phase, step.worker, step.what, step.detail)
            else:
                raise TypeError(f"{phase} makes calls and notes only, not {step!r}")

        return aside
