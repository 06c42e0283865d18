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
:class:`UpdatePlan`: the controller and the diagram both follow it.

A declaration can carry two guards that compare *data*, not machine states, and so live
beside the tables in :func:`check_declare`: an ``expected_digest`` that must equal the
digest of the weights held, and a fleet ``epoch`` that must not go backwards.

Rules of this file:

1. Everything that decides whether a command is legal lives in the two tables below.
   ``transitions`` builds the machines from them, the Mermaid diagram in
   ``docs/state-machine.md`` is rendered from them, and the tests check them against a
   hand-written matrix.
2. A trigger with no row for the current state, or whose condition is false, raises
   :class:`~weightsync.core.errors.IllegalState` and changes nothing.
3. There are no automatic transitions: the only way to move is a row of a table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, NamedTuple

from transitions import EventData, Machine, MachineError

from .errors import IllegalState


class Row(NamedTuple):
    trigger: str
    source: str
    dest: str
    condition: str | None = None


GENERATION_STATES: Final = ("running", "paused", "torn")
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
)

VERSION_TABLE: Final[tuple[Row, ...]] = (
    Row("declare", "undeclared", "declared"),
    Row("declare", "declared", "declared"),
)

GENERATION_TRIGGERS: Final = tuple(dict.fromkeys(r.trigger for r in GENERATION_TABLE))
VERSION_TRIGGERS: Final = tuple(dict.fromkeys(r.trigger for r in VERSION_TABLE))

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
}


# The choreography of an update: which triggers fire, in which order, for each way an update
# can end.  The controller fires exactly these, and the diagram draws them.
SUCCEEDED: Final = "succeeded"  # every tensor is in place and the requested cache reset happened
TORE: Final = "tore"  # it failed after writing began (or could not say what it wrote)
REFUSED: Final = "refused"  # it failed before the first write: nothing changed
ENDINGS: Final = (SUCCEEDED, TORE, REFUSED)


class UpdatePlan(NamedTuple):
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


def _allow_unpaused(event: EventData) -> bool:
    return bool(event.kwargs.get("allow_unpaused", False))


_allow_unpaused.__name__ = "allow_unpaused"

CONDITIONS: Final[dict[str, Callable[[EventData], bool]]] = {"allow_unpaused": _allow_unpaused}


def machine_kwargs(table: tuple[Row, ...], states: tuple[str, ...], initial: str) -> dict[str, Any]:
    """Arguments for a ``transitions`` machine (plain or graph) built from ``table``."""
    return {
        "states": list(states),
        "transitions": [
            {
                "trigger": r.trigger,
                "source": r.source,
                "dest": r.dest,
                **({"conditions": [CONDITIONS[r.condition]]} if r.condition else {}),
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


class _Part:
    """A ``transitions`` model: one part of the worker's state."""

    state: str


class StateMachine:
    """The worker's state: a version part and a generation part, each a ``transitions`` machine.

    ``fire`` is the only way to change it; it raises :class:`IllegalState` and leaves both
    parts as they were when the table has no row for the command.
    """

    def __init__(self, *, generation: str = "running", version: str = "undeclared") -> None:
        self._generation = _Part()
        self._version = _Part()
        Machine(model=self._generation, **machine_kwargs(GENERATION_TABLE, GENERATION_STATES, generation))
        Machine(model=self._version, **machine_kwargs(VERSION_TABLE, VERSION_STATES, version))

    @property
    def generation(self) -> str:
        return self._generation.state

    @property
    def version(self) -> str:
        return self._version.state

    def fire(self, trigger: str, **kwargs: Any) -> None:
        """Apply ``trigger``.  Raises ``IllegalState`` (state unchanged) when the table forbids it."""
        part, name = self._part(trigger)
        source = part.state
        if not try_fire(part, trigger, **kwargs):
            raise self._refusal(trigger, source, name) from None

    def _part(self, trigger: str) -> tuple[_Part, str]:
        if trigger in GENERATION_TRIGGERS:
            return self._generation, "generation"
        if trigger in VERSION_TRIGGERS:
            return self._version, "version"
        raise ValueError(f"unknown trigger {trigger!r}")

    @staticmethod
    def _refusal(trigger: str, source: str, part: str) -> IllegalState:
        code, message = REFUSALS.get(
            (trigger, source), ("illegal_state", f"{trigger} is not legal while {part} is {source}")
        )
        return IllegalState(message, code=code, state=source)

    def fire_all(self, triggers: tuple[str, ...], **kwargs: Any) -> None:
        """Fire ``triggers`` in order (an :class:`UpdatePlan`'s steps)."""
        for trigger in triggers:
            self.fire(trigger, **kwargs)

    def check(self, trigger: str, **kwargs: Any) -> None:
        """Raise ``IllegalState`` unless ``fire(trigger, **kwargs)`` would succeed now.

        Lets the controller ask before it calls the engine, so a refused command has no
        side effect, and fire only once the engine has done its part.
        """
        part, name = self._part(trigger)
        if not getattr(part, f"may_{trigger}")(**kwargs):
            raise self._refusal(trigger, part.state, name)
