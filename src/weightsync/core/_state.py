"""The weight-state machine: every legal transition, as data, in this one module.

Theory of operation
-------------------
A worker's state is two independent parts:

* **version**: ``undeclared`` until someone declares one, then ``declared`` forever.
  The declared *value* (any JSON value, ``null`` and ``"initial"`` included) is data
  carried beside the state; only the fact "declared or not" is a machine state, so
  "never declared" can never be confused with any label.
* **generation**: ``running`` (requests are served), ``paused`` (they are not), or
  ``torn``: an update failed after it had started writing weights, so the loaded weights
  match no version.  Torn is a kind of paused; only a successful complete update leaves it.

Commands are *triggers*.  An update is two triggers: ``begin_update`` decides legality
before any side effect (``running`` only with ``allow_unpaused``), and exactly one of
``update_succeeded`` / ``update_tore`` records the outcome once the engine has finished
(an update that fails before writing anything fires neither: nothing changed).
``dry_run`` validates a source and writes nothing: a row from every generation state to
itself, so it is legal anywhere (paused, running without ``allow_unpaused``, torn) and
moves nothing.  Which of these triggers an update fires, and in which order, is
:class:`UpdateSteps`: the diagram follows it, and so do the steps of
:class:`~weightsync.core.worker_state.WorkerState`, the frozen value the controller moves
(begin → succeeded / tore / refused → declare), which live beside this file.

An update session spans several requests.  ``begin_session`` decides legality once, as for
a single update (paused or torn; ``running`` is ``not_paused``); each update inside it
checks ``session_update`` and, once it wrote, fires ``session_wrote``; ``finish_session``
is the only way from a session to a committed version (its ``wrote`` guard keeps a session
that began torn and wrote nothing from healing the worker); ``abandon_session`` (no finish
within the deadline, an update that failed after writing, or an explicit abort) ends it as a
failed single update ends: ``torn`` if the weights match no version, ``paused`` otherwise.
While a session is open, single updates, resume and declarations are refused
(``session_open``; :data:`SESSION_EXCLUDES` names the declaration, which is the other part's).
:class:`SessionSteps` says which triggers each request of a session fires.

A declaration can carry two guards that compare *data*, not machine states, and so live
beside the tables in :func:`check_declare`: an ``expected_digest`` that must equal the
digest of the weights held, and a fleet ``epoch`` that must not go backwards.

Rules of this file:

1. Everything that decides whether a command is legal lives in the two tables below.
   :func:`move` looks a command up in them, the Mermaid diagram in
   ``docs/state-machine.md`` is rendered from them, and the tests check them against a
   hand-written matrix and against the ``transitions`` machines built from the same rows.
2. A trigger with no row for the current state, or whose condition (a flag named on
   :class:`ConditionModel`) is false, raises :class:`~weightsync.core.errors.IllegalState`
   and changes nothing.
3. There are no automatic transitions: the only way to move is a row of a table.
"""

from __future__ import annotations

import functools
from typing import Any, Final, NamedTuple

from transitions import EventData

from weightsync.core.errors import IllegalState
from weightsync.core.snapshot import Generation
from weightsync.core.tables import Row, triggers

GENERATION_STATES: Final = tuple(g.value for g in Generation)  # running, paused, torn, updating, ...
SESSION_STATES: Final = (Generation.UPDATING.value, Generation.UPDATING_TORN.value)
VERSION_STATES: Final = ("undeclared", "declared")

GENERATION_TABLE: Final[tuple[Row, ...]] = (
    Row("pause", "running", "paused"),
    Row("pause", "paused", "paused"),
    Row("pause", "torn", "torn"),
    Row("resume", "paused", "running"),
    Row("resume", "running", "running"),
    Row("begin_update", "paused", "paused"),
    Row("begin_update", "torn", "torn"),
    Row("begin_update", "running", "running", condition="allow_unpaused"),
    Row("update_succeeded", "paused", "paused"),
    Row("update_succeeded", "torn", "paused"),
    Row("update_succeeded", "running", "running"),
    Row("update_tore", "paused", "torn"),
    Row("update_tore", "running", "torn"),
    Row("update_tore", "torn", "torn"),
    Row("dry_run", "running", "running"),
    Row("dry_run", "paused", "paused"),
    Row("dry_run", "torn", "torn"),
    Row("dry_run", "updating", "updating"),
    Row("dry_run", "updating_torn", "updating_torn"),
    Row("pause", "updating", "updating"),
    Row("pause", "updating_torn", "updating_torn"),
    Row("begin_session", "paused", "updating"),
    Row("begin_session", "torn", "updating_torn"),
    Row("session_update", "updating", "updating"),
    Row("session_update", "updating_torn", "updating_torn"),
    Row("session_wrote", "updating", "updating_torn"),
    Row("session_wrote", "updating_torn", "updating_torn"),
    Row("finish_session", "updating", "paused"),
    Row("finish_session", "updating_torn", "paused", condition="wrote"),
    Row("abandon_session", "updating", "paused"),
    Row("abandon_session", "updating_torn", "torn"),
)

VERSION_TABLE: Final[tuple[Row, ...]] = (
    Row("declare", "undeclared", "declared"),
    Row("declare", "declared", "declared"),
)

SESSION_EXCLUDES: Final = ("declare",)
"""Triggers of the version part refused while a session is open (``session_open``): only
``finish_session`` commits a version then."""

GENERATION_TRIGGERS: Final = triggers(GENERATION_TABLE)
VERSION_TRIGGERS: Final = triggers(VERSION_TABLE)

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
    **{
        (trigger, state): ("session_open", f"a weight update session is open: {why}")
        for state in ("updating", "updating_torn")
        for trigger, why in (
            ("begin_session", "finish or abort it before starting another"),
            ("begin_update", "send updates into it (session=true), or finish or abort it first"),
            ("resume", "finish it first (only a finished session commits a version)"),
            ("declare", "the version is committed by finishing it"),
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
    """The triggers of one update request.

    ``begin`` fires before the engine is touched (it decides legality: a refusal there has
    no side effect); :meth:`ending` fires once the engine is done.  A successful update that
    carries a version also declares it, after the weights are in place.  A dry run fires its
    own row and nothing else, whatever the outcome.
    """

    declares: bool = False
    dry_run: bool = False

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
        return ("update_succeeded", "declare") if self.declares else ("update_succeeded",)

    def triggers(self, ending: str) -> tuple[str, ...]:
        """Every trigger of the update, in order, when it ends with ``ending``."""
        return self.begin + self.ending(ending)


class SessionSteps:
    """The triggers of an update session's requests, beside :class:`UpdateSteps`: the
    controller's steps fire exactly these, and the diagram draws them.

    An update inside a session checks ``session_update`` before the engine is touched and,
    once the engine says it wrote, fires ``session_wrote``; one that failed after writing then
    ends the session with ``abandon_session`` (torn).  A finish declares the version when it
    carries one, after ``finish_session`` committed the weights."""

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
    def finish(declares: bool = False) -> tuple[str, ...]:
        return ("finish_session", "declare") if declares else ("finish_session",)


def check_declare(
    *, digest: str | None, expected_digest: str | None, epoch: int | None, new_epoch: int | None
) -> None:
    """Refuse a declaration whose guards fail; nothing changes.

    Raises ``IllegalState``: ``digest_mismatch`` when ``expected_digest`` is given and the
    weights held have another (or an unknown) digest; ``stale_epoch`` when ``new_epoch`` is
    below the current ``epoch`` (an epoch never goes backwards; an equal one re-declares).
    """
    if expected_digest is not None and digest != expected_digest:
        raise IllegalState(
            f"the weights held have digest {digest or 'unknown'}, not the expected {expected_digest}",
            code="digest_mismatch",
            digest=digest,
            expected_digest=expected_digest,
        )
    if new_epoch is not None and epoch is not None and new_epoch < epoch:
        raise IllegalState(
            f"epoch {new_epoch} is older than this worker's epoch {epoch}; an epoch never goes backwards",
            code="stale_epoch",
            epoch=epoch,
        )


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


# The worker's own machine is a lookup in the tables (h11's way): a command costs one dict
# access, not a ``transitions`` event.  The tests build a ``transitions`` machine from the
# same rows (:func:`machine_kwargs`) and check that both agree on every pair.


@functools.lru_cache(maxsize=8)
def _index(table: tuple[Row, ...]) -> dict[tuple[str, str], Row]:
    rows: dict[tuple[str, str], Row] = {}
    for row in table:
        if (row.trigger, row.source) in rows:
            raise ValueError(f"two rows for {row.trigger} from {row.source}")
        if row.condition is not None and row.condition not in CONDITIONS:
            raise ValueError(f"row {row} names no condition of ConditionModel")
        rows[row.trigger, row.source] = row
    return rows


def _part(trigger: str) -> tuple[tuple[Row, ...], str]:
    # Read at each call, so a table patched in a test is the table in force.
    if trigger in GENERATION_TRIGGERS:
        return GENERATION_TABLE, "generation"
    if trigger in VERSION_TRIGGERS:
        return VERSION_TABLE, "version"
    raise ValueError(f"unknown trigger {trigger!r}")


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


def move(trigger: str, source: str, **flags: bool) -> str:
    """The state ``trigger`` leads to from ``source`` (a state of the trigger's part).

    Raises ``IllegalState`` when the table has no row for the pair or the flag its condition
    names is not set in ``flags``, and ``ValueError`` for a trigger no table names.  Pure: nothing is changed.
    """
    table, part = _part(trigger)
    row = _index(table).get((trigger, source))
    if row is None or (row.condition is not None and not flags.get(row.condition, False)):
        raise refusal(trigger, source, part) from None
    return row.dest


class StateMachine:
    """The worker's two machine states, moved only by :meth:`fire` (rows of the tables).

    Used where states are explored one trigger at a time (the diagram, the table tests); the
    controller moves a frozen :class:`~weightsync.core.worker_state.WorkerState` instead.
    """

    def __init__(self, *, generation: str = "running", version: str = "undeclared") -> None:
        self.generation = generation
        self.version = version

    def fire(self, trigger: str, **flags: Any) -> None:
        """Apply ``trigger``.  Raises ``IllegalState`` (state unchanged) when the table forbids it."""
        check_excluded(trigger, self.generation)
        dest = move(trigger, self._source(trigger), **flags)
        if trigger in VERSION_TRIGGERS:
            self.version = dest
        else:
            self.generation = dest

    def fire_all(self, triggers: tuple[str, ...], **flags: Any) -> None:
        """Fire ``triggers`` in order (what an :class:`UpdateSteps` lists)."""
        for trigger in triggers:
            self.fire(trigger, **flags)

    def check(self, trigger: str, **flags: Any) -> None:
        """Raise ``IllegalState`` unless ``fire(trigger, **flags)`` would succeed now."""
        check_excluded(trigger, self.generation)
        move(trigger, self._source(trigger), **flags)

    def _source(self, trigger: str) -> str:
        """The current state of the part ``trigger`` moves."""
        return self.version if _part(trigger)[1] == "version" else self.generation
