"""When a declaration expires, in the worker's clock: the steps that ask, and pure functions.

Every declaration the fleet sends carries ``not_after``, and the worker compares it with its
own clock when the declaration takes effect.  The coordinator's deadlines are on its own
clock, so it converts each one into the worker's, from the worker's ``clock`` route (unix
seconds, read when its reply was made).  A script yields :class:`ReadClock` (read it now:
prepare does, so that the commit needs no read of its own) and :class:`Expires` (the expiry
to send); the fan-out answers both, timing each read's round trip:

* a reading (:func:`reading`) brackets the worker's offset: the reply was made after the
  request was sent (``sent``) and before it came back (``got``), so the worker's clock runs
  ahead of this one by between ``clock - got`` and ``clock - sent``;
* the declaration carries the coordinator's deadline plus the *lowest* of those offsets
  (:func:`expiry`), so a worker that takes it up by its own clock took it up by the
  deadline on the coordinator's, whatever the skew — at the price of refusing it at most one
  round trip of the reading early;
* so a declaration that got no answer cannot land after the deadline plus
  :data:`CLOCK_MARGIN_S` (the clocks' drift since the reading, and the rounding to the
  millisecond): that is all the coordinator waits out.

A worker that reports no clock (one that predates it, or another implementation) is sent the
coordinator's deadline unchanged, and a declaration to it that got no answer is waited out
for :data:`CLOCK_SKEW_S` more: how far its clock may run behind.  Each declaration also
expires :data:`DECLARE_S` after it is sent at the latest (a declaration writes no weights).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import attrs

__all__ = [
    "CLOCK_MARGIN_S", "CLOCK_READ_S", "CLOCK_SKEW_S", "DECLARE_S", "Expires", "Expiry", "ReadClock",
    "Reading", "expiry", "reading",
]  # fmt: skip

CLOCK_SKEW_S: Final = 5.0
"""How far the clock of a worker that reports none may run behind the coordinator's.  A
declaration to it carries the coordinator's deadline, and it refuses it later by its own
clock (``commit_expired``), so once the coordinator's clock is this far past the deadline no
declaration it sent can land.  NTP keeps clocks within milliseconds of each other.  It also
bounds, for a recovery, what an unfinished transaction's commit expiry (journalled on the
coordinator's clock) needs waiting out, since no reading survives a coordinator."""

CLOCK_MARGIN_S: Final = 0.25
"""What a declaration sent by a reading of its worker's clock may land past the deadline:
the clocks' drift between the reading (at most :data:`CLOCK_READ_S` old) and the expiry (at
most :data:`DECLARE_S` later) — NTP slews a clock by 500 ppm at most, 45 ms over those 90 s —
and the millisecond the expiry is rounded to."""

CLOCK_READ_S: Final = 60.0
"""How old a reading of a worker's clock may be when a declaration is sent by it; an older
one is read again first."""

DECLARE_S: Final = 30.0
"""The longest a declaration is valid for after it is sent: it writes no weights, so a
worker that has not taken it up by then will not (it refuses it)."""

MAX_NOT_AFTER: Final = 253402300799.0
"""The latest ``not_after`` a worker accepts (the last second of the year 9999)."""


@attrs.frozen
class ReadClock:
    """Read the worker's clock now (its answer is ``None``; the driver keeps the reading)."""

    worker: str


@attrs.frozen
class Expires:
    """Ask when a declaration to the worker whose step ends at ``deadline`` (unix seconds,
    the coordinator's clock) expires: the driver answers an :class:`Expiry` by the latest
    reading of the worker's clock (read again first when there is none, or it is older than
    :data:`CLOCK_READ_S`)."""

    worker: str
    deadline: float


@attrs.frozen
class Reading:
    """What one ``clock`` round trip says of the worker's clock: ``offset``, the
    lowest its clock can run ahead of this one (seconds, negative when behind; ``None`` when
    it reports no clock), and ``at``, when the reply came back (unix seconds, this clock)."""

    offset: float | None
    at: float


@attrs.frozen
class Expiry:
    """A declaration's expiry: ``theirs``, the ``not_after`` to send (the worker's clock), and
    ``until``, after which it can no longer land (unix seconds, this clock)."""

    theirs: float
    until: float


def reading(reply: Mapping[str, Any], sent: float, got: float) -> Reading:
    """The :class:`Reading` of a ``clock`` ``reply`` (``{}`` from a worker without the route)
    to a request sent at ``sent`` that came back at ``got`` (unix seconds, this clock).  A
    ``clock`` that is not a finite number of unix seconds above 0 (a foreign or broken
    worker) counts as none."""
    clock = reply.get("clock")
    if isinstance(clock, bool) or not isinstance(clock, int | float):
        return Reading(None, got)
    usable = 0 < clock < MAX_NOT_AFTER  # exact for any int (no float overflow), false for NaN and inf
    return Reading(float(clock) - got if usable else None, got)


def expiry(deadline: float, read: Reading | None, now: float) -> Expiry:
    """The :class:`Expiry` of a declaration sent at ``now`` whose step ends at ``deadline``
    (unix seconds, this clock), by the worker's reading ``read`` (``None``, or one without a
    clock: the coordinator's deadline as it is, waited out for :data:`CLOCK_SKEW_S` more)."""
    end = min(deadline, now + DECLARE_S)
    if read is None or read.offset is None:
        return Expiry(round(end, 3), end + CLOCK_SKEW_S)
    theirs = math.floor((end + read.offset) * 1000) / 1000  # rounded down: never later
    return Expiry(min(max(theirs, 0.001), MAX_NOT_AFTER), end + CLOCK_MARGIN_S)
