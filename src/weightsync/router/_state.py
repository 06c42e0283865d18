"""A worker's routing state, as the router sees it: every legal move, as data, in this module.

Theory of operation
-------------------
The router keeps one small machine per worker.  Its state says whether completions may go
there:

* ``unknown``: not yet observed (at start, and after the router handed the worker back
  from an update or a resume: the next poll decides).
* ``routable``: it answers, runs, is not torn, has no update in flight, and reports the
  (version, epoch, digest) the journal committed for it.  Only this state takes requests.
* ``paused``: the router paused it (``/fleet/pause_generation``); a poll that sees it paused
  is expected, not a fault.
* ``draining``: a fleet update took it out of routing; requests already sent finish.
* ``updating``: the fleet transaction is working on it (paused, loading, verifying).
* ``fenced``: it answers, but is paused behind the router's back, torn, mid-update, or on a
  (version, epoch, digest) nobody committed.
* ``unreachable``: it did not answer a poll in time, or refused a request's connection.
  Like ``fenced``, it is out of routing.

Two kinds of triggers move it.  *Observations* come from the poller, one per poll, decided
by :func:`observe` from the worker's ``get_weight_version`` reply and the label committed
for it: ``seen_committed``, ``seen_paused``, ``seen_uncommitted``, ``lost``.  *Actions* are
the router's own: ``drain`` → ``update`` → ``release`` around a transaction, ``pause`` and
``resume`` around an admin pause.  While a worker is ``draining`` or ``updating`` the
transaction owns it, so observations leave it where it is.

Leaving fencing: a fenced (or unreachable) worker returns to ``routable`` as soon as a poll
sees it running on its committed label.  So a worker paused behind the router's back comes
back with a plain resume (its digest proves it still holds the committed weights), one that
only stopped answering comes back when it answers again; a worker that holds weights nobody
committed (a foreign load, a torn update, a restart with fresh weights) needs a fleet
transaction, which drains, updates and releases it like every other worker.

Rules of this file:

1. Everything that decides where a worker may go lives in ``TABLE`` and :func:`observe`.
   ``transitions`` builds the machine from the table, ``docs/router.md`` embeds the diagram
   rendered from it, and the tests check it against a hand-written matrix.
2. A trigger with no row for the current state changes nothing (:meth:`RoutingMachine.fire`
   says so by returning ``False``; the router uses that to skip workers an action does not
   apply to).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any, Final

import attrs

from weightsync.core.tables import Row, TableMachine, rows, triggers

STATES: Final = ("unknown", "routable", "paused", "draining", "updating", "fenced", "unreachable")
INITIAL: Final = "unknown"
FENCED: Final = frozenset({"fenced", "unreachable"})
OWNED: Final = frozenset({"draining", "updating"})  # a transaction holds these: polls are ignored

OBSERVATIONS: Final = ("seen_committed", "seen_paused", "seen_uncommitted", "lost")
_WATCHED: Final = ("unknown", "routable", "paused", "fenced", "unreachable")

TABLE: Final[tuple[Row, ...]] = (
    # what a poll saw
    *rows("seen_committed", _WATCHED, "routable"),
    *(Row("seen_paused", s, "paused" if s == "paused" else "fenced") for s in _WATCHED),
    *rows("seen_uncommitted", _WATCHED, "fenced"),
    *rows("lost", _WATCHED, "unreachable"),
    *(r for t in OBSERVATIONS for r in rows(t, ("draining", "updating"))),
    # what the router does
    *rows("drain", _WATCHED, "draining"),
    Row("update", "draining", "updating"),
    *rows("release", ("draining", "updating"), "unknown"),
    *rows("pause", ("unknown", "routable", "paused"), "paused"),
    Row("resume", "paused", "unknown"),
)

TRIGGERS: Final = triggers(TABLE)


class RoutingMachine:
    """One worker's routing state.  :meth:`fire` is the only way to change it."""

    def __init__(self, state: str = INITIAL) -> None:
        self._machine = TableMachine(TABLE, STATES, state, what="routing state")

    @property
    def state(self) -> str:
        return self._machine.state

    @property
    def routable(self) -> bool:
        return self.state == "routable"

    @property
    def fenced(self) -> bool:
        return self.state in FENCED

    def fire(self, trigger: str) -> bool:
        """Apply ``trigger``; ``False`` (state unchanged) when the table has no row for it.

        Raises ``ValueError`` for a trigger the table never names.
        """
        return self._machine.fire(trigger)


def canonical(value: Any) -> str:
    """A version value as canonical JSON, so ``1``, ``1.0`` and ``true`` stay three versions."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@attrs.frozen
class Label:
    """What a worker says it serves: its version (declared or not), fleet epoch and digest."""

    declared: bool
    version: Any
    epoch: int | None
    digest: str | None

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> Label:
        """The label in a ``get_weight_version`` reply (missing fields are ``None``)."""
        epoch = reply.get("epoch")
        digest = reply.get("digest")
        return cls(
            reply.get("version_declared") is True,
            reply.get("version"),
            epoch if type(epoch) is int else None,
            digest if isinstance(digest, str) else None,
        )

    def same(self, other: Label | None) -> bool:
        """Whether ``other`` names the same weights under the same label (digest known)."""
        return (
            other is not None
            and self.digest is not None
            and self.digest == other.digest
            and self.declared == other.declared
            and self.epoch == other.epoch
            and self.canonical_version == other.canonical_version
        )

    @functools.cached_property
    def canonical_version(self) -> str:
        """:func:`canonical` of the version (computed once: every routed reply compares it)."""
        return canonical(self.version)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "version_declared": self.declared,
            "epoch": self.epoch,
            "digest": self.digest,
        }


def observe(reply: Mapping[str, Any] | None, committed: Label | None) -> str:
    """The observation trigger for one poll: ``reply`` is the worker's ``get_weight_version``
    answer (``None`` when it did not answer), ``committed`` the label committed for it.

    ``seen_uncommitted`` wins over ``seen_paused``: a worker that is torn, mid-update or on
    an uncommitted label is fenced whatever its generation state.
    """
    if reply is None:
        return "lost"
    if reply.get("torn") is not False or reply.get("update_in_flight") is not False:
        return "seen_uncommitted"
    if not Label.from_reply(reply).same(committed):
        return "seen_uncommitted"
    if reply.get("paused") is not False:
        return "seen_paused"
    return "seen_committed"
