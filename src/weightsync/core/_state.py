"""The weight-state machine: every legal transition, as data, in this one module.

Theory of operation
-------------------
A worker's state is four independent parts:

* **version**: ``undeclared`` until someone declares one, then ``declared`` forever.
  The declared *value* (any JSON value, ``null`` and ``"initial"`` included) is data
  carried beside the state; only the fact "declared or not" is a machine state, so
  "never declared" can never be confused with any label.
* **generation**: ``running`` (requests are served), ``paused`` (they are not), or
  ``torn``: an update failed after it had started writing weights, so the loaded weights
  match no version.  Torn is a kind of paused; only a successful complete update leaves it.

Commands are *triggers*.  An update is ``begin_update`` (legality, before any side effect:
``running`` only with ``allow_unpaused``), then exactly one of ``update_succeeded`` /
``update_tore`` (an update that fails before writing fires neither).  ``dry_run`` writes
nothing and is legal in every generation state.  :class:`UpdateSteps` says which triggers an
update fires, in which order; the diagram and the steps of
:class:`~weightsync.core.worker_state.WorkerState` follow it.

An update session spans several requests: ``begin_session`` decides legality once;
each update in it checks ``session_update`` and, once it wrote, fires ``session_wrote``;
``finish_session`` is the only way from a session to a committed version (its ``wrote`` guard
keeps a session that began torn and wrote nothing from healing the worker);
``abandon_session`` ends it as a failed update ends (``torn`` if the weights match no
version).  While a session is open, single updates, resume and declarations are refused
(``session_open``; :data:`SESSION_EXCLUDES`).  :class:`SessionSteps` lists its triggers.

Memory (colocated RL: SGLang's ``release/resume_memory_occupation``, vLLM's sleep/wake) is two
more parts: **weights** (``resident``; ``offloaded``, kept in host memory and restored as they
were; ``discarded``, freed: the worker holds no version's weights) and **kv_cache**
(``resident`` or ``released``, restored empty).  ``release_memory`` is legal only while paused
or torn (a dialect that releases a serving worker pauses it first, as vLLM's sleep does), then
``offload_weights`` / ``discard_weights`` / ``release_kv`` move the memory parts.
``restore_weights`` brings offloaded weights back; discarded ones get memory but no content,
so only ``weights_loaded`` (an update, or a session's finish, that rewrote every discarded
tensor) makes them ``resident``.  ``resume`` needs both parts resident; an update or a session
needs weights that are not ``offloaded``.  A trigger is looked up in every table naming it.

A declaration's guards compare *data*, not machine states, and so live with the data, in
:func:`~weightsync.core.held.check_declare` (an ``expected_digest``, a fleet ``epoch``).

Rules of this file:

1. Everything that decides whether a command is legal lives in the tables below.
   :func:`move` looks a command up in them, the Mermaid diagram in
   ``docs/state-machine.md`` is rendered from them, and the tests check them against a
   hand-written matrix and against the ``transitions`` machines built from the same rows.
2. A trigger with no row for the current state, or whose condition (a flag named on
   :class:`ConditionModel`) is false, raises :class:`~weightsync.core.errors.IllegalState`
   and changes nothing.
3. There are no automatic transitions: the only way to move is a row of a table.  A command
   is a lookup in the tables (h11's way), not a ``transitions`` event.
"""

from __future__ import annotations

import functools
from typing import Any, Final, NamedTuple

from transitions import EventData

from weightsync.core.errors import IllegalState
from weightsync.core.snapshot import Generation
from weightsync.core.tables import Row, index, rows, triggers

GENERATION_STATES: Final = tuple(g.value for g in Generation)  # running, paused, torn, updating, ...
SESSION_STATES: Final = (Generation.UPDATING.value, Generation.UPDATING_TORN.value)
VERSION_STATES: Final = ("undeclared", "declared")
WEIGHTS_STATES: Final = ("resident", "offloaded", "discarded")
KV_STATES: Final = ("resident", "released")

GENERATION_TABLE: Final[tuple[Row, ...]] = (
    Row("pause", "running", "paused"),
    *rows("pause", ("paused", "torn")),
    Row("resume", "paused", "running"),
    Row("resume", "running", "running"),
    *rows("begin_update", ("paused", "torn")),
    Row("begin_update", "running", "running", condition="allow_unpaused"),
    *rows("update_succeeded", ("paused", "running")),
    Row("update_succeeded", "torn", "paused"),
    *rows("update_tore", ("paused", "running", "torn"), "torn"),
    *rows("dry_run", GENERATION_STATES),
    *rows("pause", SESSION_STATES),
    Row("begin_session", "paused", "updating"),
    Row("begin_session", "torn", "updating_torn"),
    *rows("session_update", SESSION_STATES),
    *rows("session_wrote", SESSION_STATES, "updating_torn"),
    Row("finish_session", "updating", "paused"),
    Row("finish_session", "updating_torn", "paused", condition="wrote"),
    Row("abandon_session", "updating", "paused"),
    Row("abandon_session", "updating_torn", "torn"),
    *rows("release_memory", ("paused", "torn")),
)

VERSION_TABLE: Final[tuple[Row, ...]] = (
    Row("declare", "undeclared", "declared"),
    Row("declare", "declared", "declared"),
)

WEIGHTS_TABLE: Final[tuple[Row, ...]] = (
    Row("offload_weights", "resident", "offloaded"),
    Row("offload_weights", "offloaded", "offloaded"),
    Row("offload_weights", "discarded", "discarded"),  # nothing held to offload
    *rows("discard_weights", WEIGHTS_STATES, "discarded"),
    Row("restore_weights", "resident", "resident"),
    Row("restore_weights", "offloaded", "resident"),
    Row("restore_weights", "discarded", "discarded"),  # memory back, no version's weights in it
    *rows("weights_loaded", ("resident", "discarded"), "resident"),
    Row("resume", "resident", "resident"),
    *rows("begin_update", ("resident", "discarded")),
    *rows("begin_session", ("resident", "discarded")),
)

KV_TABLE: Final[tuple[Row, ...]] = (
    *rows("release_kv", KV_STATES, "released"),
    *rows("restore_kv", KV_STATES, "resident"),
    Row("resume", "resident", "resident"),
)

SESSION_EXCLUDES: Final = ("declare",)
"""Triggers of the version part refused while a session is open (``session_open``): only
``finish_session`` commits a version then."""

GENERATION_TRIGGERS: Final = triggers(GENERATION_TABLE)
VERSION_TRIGGERS: Final = triggers(VERSION_TABLE)
MEMORY_TRIGGERS: Final = tuple(t for t in triggers(WEIGHTS_TABLE + KV_TABLE) if t not in GENERATION_TRIGGERS)
PARTS: Final = ("generation", "version", "weights", "kv_cache")

# Why a trigger is refused, per (trigger, state), for the error message and code.
REFUSALS: Final[dict[tuple[str, str], tuple[str, str]]] = {
    ("resume", "torn"): (
        "weights_torn",
        "cannot resume: the last update failed part-way, so the loaded weights match no "
        "version; run a complete update first",
    ),
    ("begin_update", "running"): (
        "not_paused",
        "cannot update while generation is running; pause first or pass allow_unpaused=true",
    ),
    ("begin_session", "running"): (
        "not_paused",
        "cannot start a weight update session while generation is running; pause first",
    ),
    ("release_memory", "running"): ("not_paused", "cannot release memory while running; pause first"),
    ("resume", "discarded"): (
        "weights_released",
        "the weights were discarded, so this worker holds no version's weights: load an update first",
    ),
    **{
        (trigger, "offloaded"): ("weights_offloaded", "the weights are offloaded: restore them first")
        for trigger in ("resume", "begin_update", "begin_session")
    },
    ("resume", "released"): ("kv_released", "the KV cache is released: restore it first"),
    **{
        (trigger, state): ("session_open", f"a weight update session is open: {why}")
        for state in ("updating", "updating_torn")
        for trigger, why in (
            ("begin_session", "finish or abort it before starting another"),
            ("begin_update", "send updates into it (session=true), or finish or abort it first"),
            ("resume", "finish it first (only a finished session commits a version)"),
            ("declare", "the version is committed by finishing it"),
            ("release_memory", "finish or abort it first"),
        )
    },
    **{
        (trigger, state): ("no_session", f"no weight update session is open ({trigger}): begin one first")
        for state in ("running", "paused", "torn")
        for trigger in ("session_update", "session_wrote", "finish_session", "abandon_session")
    },
    ("finish_session", "updating_torn"): (
        "weights_torn",
        "the session wrote nothing and began on a torn worker: the weights still match no version; "
        "send the tensors before finishing",
    ),
}


# The choreography of an update: which triggers fire, in which order, for each way an update
# can end.  The controller fires exactly these, and the diagram draws them.
SUCCEEDED: Final = "succeeded"  # every tensor is in place and the requested cache reset happened
TORE: Final = "tore"  # it failed after writing began (or could not say what it wrote)
REFUSED: Final = "refused"  # it failed before the first write: nothing changed
ENDINGS: Final = (SUCCEEDED, TORE, REFUSED)


class UpdateSteps(NamedTuple):
    """The triggers of one update request: ``begin`` before the engine is touched (a refusal
    there has no side effect), :meth:`ending` once it is done.  A successful update that
    carries a version declares it after the weights are in place; a dry run fires only its row."""

    declares: bool = False
    dry_run: bool = False
    restores: bool = False
    """The update rewrote every discarded tensor: the weights are resident again."""

    @property
    def begin(self) -> tuple[str, ...]:
        return ("dry_run",) if self.dry_run else ("begin_update",)

    def ending(self, ending: str) -> tuple[str, ...]:
        """The triggers for ``ending`` (one of :data:`ENDINGS`), after :attr:`begin`."""
        if ending not in ENDINGS:
            raise ValueError(f"unknown ending {ending!r}")
        if self.dry_run or ending == REFUSED:
            return ()
        if ending == TORE:
            return ("update_tore",)
        restored = ("weights_loaded",) if self.restores else ()
        return ("update_succeeded", *restored, *(("declare",) if self.declares else ()))

    def triggers(self, ending: str) -> tuple[str, ...]:
        """Every trigger of the update, in order, when it ends with ``ending``."""
        return self.begin + self.ending(ending)


class SessionSteps:
    """The triggers of an update session's requests (the controller fires these, the diagram
    draws them): an update checks ``session_update`` and, once it wrote, fires
    ``session_wrote`` (then ``abandon_session`` if it failed); a finish declares its version
    after ``finish_session`` committed the weights."""

    begin: Final = ("begin_session",)
    abandon: Final = ("abandon_session",)

    @staticmethod
    def update(ending: str, wrote: bool = True) -> tuple[str, ...]:
        """The triggers of one update inside a session that ends with ``ending`` (an update
        that succeeded but wrote nothing only checks)."""
        if ending not in ENDINGS:
            raise ValueError(f"unknown ending {ending!r}")
        if ending == REFUSED or (ending == SUCCEEDED and not wrote):
            return ("session_update",)
        if ending == TORE:
            return ("session_update", "session_wrote", "abandon_session")
        return ("session_update", "session_wrote")

    @staticmethod
    def finish(declares: bool = False, restores: bool = False) -> tuple[str, ...]:
        restored = ("weights_loaded",) if restores else ()
        return ("finish_session", *restored, *(("declare",) if declares else ()))


class MemorySteps:
    """The triggers of a memory command: a release (``weights``: ``"offload"``, ``"discard"``
    or ``None``, kept; the KV cache when ``kv_cache``) or a restore (of either, or both)."""

    WEIGHTS: Final = {"offload": "offload_weights", "discard": "discard_weights"}

    @staticmethod
    def release(weights: str | None, kv_cache: bool) -> tuple[str, ...]:
        freed = () if weights is None else (MemorySteps.WEIGHTS[weights],)
        return ("release_memory", *freed, *(("release_kv",) if kv_cache else ()))

    @staticmethod
    def restore(weights: bool, kv_cache: bool) -> tuple[str, ...]:
        return (*(("restore_weights",) if weights else ()), *(("restore_kv",) if kv_cache else ()))


class ConditionModel:
    """The conditions of the tables, named on the model: a row's ``condition`` is the name of
    a method here that reads the command's flag of the same name.  A ``transitions`` model
    built with :func:`machine_kwargs` inherits them (``transitions`` resolves a condition given
    as a string on the model); :func:`move` reads the same flags."""

    def allow_unpaused(self, event: EventData) -> bool:
        return bool(event.kwargs.get("allow_unpaused", False))

    def wrote(self, event: EventData) -> bool:
        """The session being finished wrote tensors."""
        return bool(event.kwargs.get("wrote", False))


CONDITIONS: Final = frozenset(name for name in vars(ConditionModel) if not name.startswith("_"))


@functools.lru_cache(maxsize=8)
def _index(table: tuple[Row, ...]) -> dict[tuple[str, str], Row]:
    return index(table, CONDITIONS, "ConditionModel")


@functools.lru_cache(maxsize=16)
def _named(table: tuple[Row, ...]) -> frozenset[str]:
    return frozenset(triggers(table))


def _tables() -> dict[str, tuple[Row, ...]]:
    # Read at each call, so a table patched in a test is the table in force.
    return {
        "generation": GENERATION_TABLE,
        "version": VERSION_TABLE,
        "weights": WEIGHTS_TABLE,
        "kv_cache": KV_TABLE,
    }


def parts_of(trigger: str) -> tuple[str, ...]:
    """The parts whose tables name ``trigger`` (in :data:`PARTS` order); ``ValueError`` for none."""
    parts = tuple(part for part, table in _tables().items() if trigger in _named(table))
    if not parts:
        raise ValueError(f"unknown trigger {trigger!r}")
    return parts


def refusal(trigger: str, source: str, part: str) -> IllegalState:
    """The error for ``trigger`` refused while ``part`` is ``source`` (see :data:`REFUSALS`)."""
    code, message = REFUSALS.get(
        (trigger, source), ("illegal_state", f"{trigger} is not legal while {part} is {source}")
    )
    return IllegalState(message, code=code, state=source)


def check_excluded(trigger: str, generation: str) -> None:
    """Raise ``IllegalState`` (``session_open``) for a version-part trigger that an open
    session forbids (:data:`SESSION_EXCLUDES`)."""
    if trigger in SESSION_EXCLUDES and generation in SESSION_STATES:
        raise refusal(trigger, generation, "generation")


def move(trigger: str, source: str, part: str | None = None, **flags: bool) -> str:
    """The state ``trigger`` leads ``part`` to from ``source`` (``part``: the first of
    :func:`parts_of`, when not given).

    Raises ``IllegalState`` when the table has no row for the pair or the flag its condition
    names is not set in ``flags``, and ``ValueError`` for a trigger no table names.  Pure: nothing is changed.
    """
    part = part or parts_of(trigger)[0]
    row = _index(_tables()[part]).get((trigger, source))
    if row is None or (row.condition is not None and not flags.get(row.condition, False)):
        raise refusal(trigger, source, part) from None
    return row.dest


def moved(trigger: str, states: dict[str, str], **flags: bool) -> dict[str, str]:
    """``states`` (part -> state, every part of :data:`PARTS`) after ``trigger``: every part
    whose table names it moves, or none does (``IllegalState``, the first part refusing)."""
    check_excluded(trigger, states["generation"])
    return {**states, **{p: move(trigger, states[p], p, **flags) for p in parts_of(trigger)}}


class StateMachine:
    """The worker's machine states, one per part of :data:`PARTS`, moved only by :meth:`fire`
    (rows of the tables).

    Used where states are explored one trigger at a time (the diagram, the table tests); the
    controller moves a frozen :class:`~weightsync.core.worker_state.WorkerState` instead.
    """

    def __init__(
        self, *, generation: str = "running", version: str = "undeclared", weights: str = "resident",
        kv_cache: str = "resident",
    ) -> None:  # fmt: skip
        self.generation, self.version, self.weights, self.kv_cache = generation, version, weights, kv_cache

    @property
    def states(self) -> dict[str, str]:
        return {part: getattr(self, part) for part in PARTS}

    def fire(self, trigger: str, **flags: Any) -> None:
        """Apply ``trigger``.  Raises ``IllegalState`` (state unchanged) when a table forbids it."""
        for part, state in moved(trigger, self.states, **flags).items():
            setattr(self, part, state)

    def fire_all(self, triggers: tuple[str, ...], **flags: Any) -> None:
        """Fire ``triggers`` in order (what an :class:`UpdateSteps` lists)."""
        for trigger in triggers:
            self.fire(trigger, **flags)

    def check(self, trigger: str, **flags: Any) -> None:
        """Raise ``IllegalState`` unless ``fire(trigger, **flags)`` would succeed now."""
        moved(trigger, self.states, **flags)
