"""The adapter-slot machine: every legal move of one LoRA slot, as data, in this one module.

Theory of operation
-------------------
Each adapter name a worker serves is a *slot* of two parts, apart from the base's state:

* **residency**: ``absent`` (nothing under the name), ``loading`` (a first load is under
  way: nothing is served yet), ``resident`` (served), ``replacing`` (a new version is being
  loaded while the old one is still served), ``evicting`` (an unload is under way);
* **version**: ``undeclared`` or ``declared``, as the base's.  The declared value, the digest
  it was declared for and the adapter's digest are data beside the state
  (:class:`~weightsync.lora.slots.Slot`).

A load is ``begin_load`` (legality, before the engine is touched: a first load needs a free
slot, the ``room`` condition of ``serve --max-loras``), then exactly one of ``load_succeeded``
(and ``declare`` when the load names a version) or ``load_refused``, which puts the slot back
where it was: ``absent``, or ``resident`` with the old version still served.  An unload is
``begin_evict`` then ``evict_done`` (the slot is forgotten: ``absent, undeclared``) or
``evict_refused`` (still ``resident``).  No trigger of these tables is a trigger of the
base's tables: a slot's moves can neither tear nor pause the base, nor touch another slot.
:class:`LoadSteps` and :class:`UnloadSteps` list the triggers each command fires, in order.

Rules of this file (those of :mod:`weightsync.core._state`, for slots):

1. Everything that decides whether a slot command is legal lives in the tables below; the
   diagram in ``docs/state-machine.md`` is rendered from them (:mod:`weightsync.lora.diagram`)
   and the tests check them against a hand-written matrix and against ``transitions``
   machines built from the same rows.
2. A trigger with no row for the current state, or whose condition is false, is refused with
   the error of :data:`REFUSALS` and changes nothing.
3. A trigger is looked up in every table naming it: all parts move, or none does.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Final

from transitions import EventData

from weightsync.core.errors import IllegalState, NotFound, WeightSyncError
from weightsync.core.tables import Row, index, rows, triggers

RESIDENCY_STATES: Final = ("absent", "loading", "resident", "replacing", "evicting")
VERSION_STATES: Final = ("undeclared", "declared")
BUSY: Final = ("loading", "replacing", "evicting")
PARTS: Final = ("residency", "version")

RESIDENCY_TABLE: Final[tuple[Row, ...]] = (
    Row("begin_load", "absent", "loading", condition="room"),
    Row("begin_load", "resident", "replacing"),
    *rows("load_succeeded", ("loading", "replacing"), "resident"),
    Row("load_refused", "loading", "absent"),
    Row("load_refused", "replacing", "resident"),
    Row("declare", "resident", "resident"),
    Row("begin_evict", "resident", "evicting"),
    Row("evict_done", "evicting", "absent"),
    Row("evict_refused", "evicting", "resident"),
)

VERSION_TABLE: Final[tuple[Row, ...]] = (
    *rows("declare", VERSION_STATES, "declared"),
    *rows("evict_done", VERSION_STATES, "undeclared"),
)

TRIGGERS: Final = triggers(RESIDENCY_TABLE + VERSION_TABLE)

# Why a trigger is refused, per (trigger, residency): the error's class, code and message.
REFUSALS: Final[dict[tuple[str, str], tuple[type[WeightSyncError], str, str]]] = {
    ("begin_load", "absent"): (
        IllegalState,
        "adapter_slots_full",
        "every adapter slot is taken (serve --max-loras): unload an adapter first",
    ),
    ("begin_evict", "absent"): (NotFound, "adapter_not_found", "no adapter is loaded under this name"),
    ("declare", "absent"): (NotFound, "adapter_not_found", "no adapter is loaded under this name"),
    **{
        (trigger, state): (IllegalState, "adapter_busy", f"the adapter is {state}: wait for that to finish")
        for state in BUSY
        for trigger in ("begin_load", "begin_evict", "declare")
    },
}

SUCCEEDED: Final = "succeeded"  # the engine serves the new version under the name
REFUSED: Final = "refused"  # nothing changed: the slot is as it was before the load
ENDINGS: Final = (SUCCEEDED, REFUSED)


class LoadSteps:
    """The triggers of a load (the command fires these, the diagram draws them)."""

    begin: Final = ("begin_load",)

    @staticmethod
    def ending(ending: str, declares: bool = False) -> tuple[str, ...]:
        """The triggers after :attr:`begin` when the load ends with ``ending``."""
        if ending not in ENDINGS:
            raise ValueError(f"unknown ending {ending!r}")
        if ending == REFUSED:
            return ("load_refused",)
        return ("load_succeeded", *(("declare",) if declares else ()))


class UnloadSteps:
    """The triggers of an unload."""

    begin: Final = ("begin_evict",)
    done: Final = ("evict_done",)
    refused: Final = ("evict_refused",)


class SlotConditions:
    """The tables' conditions by name, for a ``transitions`` model built from them."""

    def room(self, event: EventData) -> bool:
        """A slot is free (``serve --max-loras``)."""
        return bool(event.kwargs.get("room", False))


CONDITIONS: Final = frozenset(name for name in vars(SlotConditions) if not name.startswith("_"))


@functools.lru_cache(maxsize=4)
def _index(table: tuple[Row, ...]) -> dict[tuple[str, str], Row]:
    return index(table, CONDITIONS, "SlotConditions")


def _tables() -> dict[str, tuple[Row, ...]]:
    # Read at each call, so a table patched in a test is the table in force.
    return {"residency": RESIDENCY_TABLE, "version": VERSION_TABLE}


def refusal(trigger: str, residency: str, name: str = "") -> WeightSyncError:
    """The error for ``trigger`` refused while the slot ``name`` is ``residency``."""
    cls, code, message = REFUSALS.get(
        (trigger, residency),
        (IllegalState, "illegal_state", f"{trigger} is not legal while the adapter is {residency}"),
    )
    where = f"adapter {name[:200]!r}: " if name else ""
    return cls(f"{where}{message}", code=code, state=residency, **({"adapter": name[:200]} if name else {}))


def moved(
    trigger: str, states: dict[str, str], name: str = "", flags: Mapping[str, bool] | None = None
) -> dict[str, str]:
    """``states`` (part -> state) after ``trigger`` (``flags``: the conditions that hold, by
    name): every part whose table names it moves, or none does (the refusal of
    :func:`refusal`, naming the slot ``name``).  Pure; ``ValueError`` for a trigger no table
    names."""
    flags = flags or {}
    named = [part for part, table in _tables().items() if trigger in triggers(table)]
    if not named:
        raise ValueError(f"unknown trigger {trigger!r}")
    out = dict(states)
    for part in named:
        row = _index(_tables()[part]).get((trigger, states[part]))
        if row is None or (row.condition is not None and not flags.get(row.condition, False)):
            raise refusal(trigger, states["residency"], name) from None
        out[part] = row.dest
    return out


def moved_all(
    triggers_: tuple[str, ...],
    states: dict[str, str],
    name: str = "",
    flags: Mapping[str, bool] | None = None,
) -> dict[str, str]:
    """``states`` after each of ``triggers_`` in order (:func:`moved`)."""
    for trigger in triggers_:
        states = moved(trigger, states, name, flags)
    return states
