"""The table-machine kit: a state machine whose every legal move is a :class:`Row` of a table.

The worker (:mod:`weightsync.core._state`), a fleet transaction (:mod:`weightsync.fleet._state`)
and the router's view of a worker (:mod:`weightsync.router._state`) each write their legality as
rows of plain data and use this one kit to build a ``transitions`` machine from them
(:func:`machine_kwargs`), fire a trigger (:func:`try_fire`) or hold one state that only a row
can move (:class:`TableMachine`).  Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from transitions import Machine, MachineError


class Row(NamedTuple):
    """One legal move: ``trigger`` takes ``source`` to ``dest`` (when ``condition``, a flag of
    the model, is true)."""

    trigger: str
    source: str
    dest: str
    condition: str | None = None


def rows(trigger: str, sources: Iterable[str], dest: str | None = None) -> tuple[Row, ...]:
    """One row per source: ``trigger`` takes each of ``sources`` to ``dest``, or leaves each
    where it is when ``dest`` is ``None``."""
    return tuple(Row(trigger, s, s if dest is None else dest) for s in sources)


def path(start: str, *steps: tuple[str, str]) -> tuple[Row, ...]:
    """The rows of one path from ``start``: each ``(trigger, dest)`` step moves on from where
    the step before it ended."""
    sources = (start, *(dest for _, dest in steps[:-1]))
    return tuple(Row(trigger, source, dest) for source, (trigger, dest) in zip(sources, steps, strict=True))


def machine_kwargs(table: tuple[Row, ...], states: tuple[str, ...], initial: str) -> dict[str, Any]:
    """Arguments for a ``transitions`` machine (plain or graph) built from ``table``, on a
    model with the condition methods its rows name."""
    return {
        "states": list(states),
        "transitions": [
            {
                "trigger": r.trigger,
                "source": r.source,
                "dest": r.dest,
                **({"conditions": [r.condition]} if r.condition else {}),
            }
            for r in table
        ],
        "initial": initial,
        "auto_transitions": False,
        "ignore_invalid_triggers": False,
        "send_event": True,
    }


def try_fire(model: Any, trigger: str, **kwargs: Any) -> bool:
    """Fire ``trigger`` on a ``transitions`` model; ``False`` (state unchanged) when no row allows it."""
    try:
        return bool(getattr(model, trigger)(**kwargs))
    except MachineError:
        return False


def index(table: tuple[Row, ...], conditions: frozenset[str], model: str) -> dict[tuple[str, str], Row]:
    """``table``'s rows by ``(trigger, source)``.  Raises ``ValueError`` for two rows of one
    pair, or a row whose condition is none of ``conditions`` (the condition methods of
    ``model``, named in the message)."""
    found: dict[tuple[str, str], Row] = {}
    for row in table:
        if (row.trigger, row.source) in found:
            raise ValueError(f"two rows for {row.trigger} from {row.source}")
        if row.condition is not None and row.condition not in conditions:
            raise ValueError(f"row {row} names no condition of {model}")
        found[row.trigger, row.source] = row
    return found


def triggers(table: tuple[Row, ...]) -> tuple[str, ...]:
    """The triggers ``table`` names, in the order of their first row."""
    return tuple(dict.fromkeys(r.trigger for r in table))


class _Model:
    state: str


class TableMachine:
    """One state of a table, moved only by :meth:`fire`.  What a fleet transaction and the
    router's view of a worker hold (each composes one; neither inherits it)."""

    def __init__(
        self, table: tuple[Row, ...], states: tuple[str, ...], state: str, *, what: str = "state"
    ) -> None:
        if state not in states:
            raise ValueError(f"unknown {what} {state!r}")
        self._triggers = frozenset(triggers(table))
        self._model = _Model()
        Machine(model=self._model, **machine_kwargs(table, states, state))

    @property
    def state(self) -> str:
        return self._model.state

    def fire(self, trigger: str) -> bool:
        """Apply ``trigger``; ``False`` (state unchanged) when the table has no row for it.

        Raises ``ValueError`` for a trigger the table never names.
        """
        if trigger not in self._triggers:
            raise ValueError(f"unknown trigger {trigger!r}")
        return try_fire(self._model, trigger)
