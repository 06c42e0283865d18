"""The point-to-point operations of a sharded plan that are on the wire at once, on either
side of a message."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol


class Waits(Protocol):
    """A group whose operations :class:`Flight` waits for (a plan's group, joined by this
    process or by a helper)."""

    def wait(self, work: Any) -> None: ...


class Flight:
    """At most ``depth`` point-to-point operations in flight; each finished one runs its
    follow-up.  (The plan's global order makes any depth deadlock-free.)

    :meth:`add` takes the operation *unstarted*: it is started only once there is room, so
    when it starts, the operation two back (same depth 2) has finished and run its follow-up.
    That is what makes a buffer safe to reuse: the destination's packing buffers alternate,
    so a receive into buffer 0 starts only after the previous receive into buffer 0 was
    waited for and unpacked.  (Starting it first, then making room, let a receive overwrite
    a buffer whose bytes were still being unpacked: corrupt pieces, which the checksums
    caught, with two receives in flight.)"""

    def __init__(self, group: Waits, depth: int = 2) -> None:
        self.group, self.depth = group, depth
        self.pending: deque[tuple[Any, Callable[[], None] | None]] = deque()

    def make_room(self) -> None:
        while len(self.pending) >= self.depth:
            self._finish_oldest()

    def add(self, start: Callable[[], Any], then: Callable[[], None] | None = None) -> None:
        self.make_room()
        self.pending.append((start(), then))

    def drain(self) -> None:
        while self.pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, then = self.pending.popleft()
        self.group.wait(work)
        if then is not None:
            then()
