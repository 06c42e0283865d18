"""Draw the worker's state (version × generation) from the tables of ``_state.py``.

A reader needs the *product*: an update that carries ``weight_version`` moves both parts
at once, and a torn worker keeps its label.  So each node here is one (version,
generation) pair, and each edge is a request a user sends, found by firing that request's
triggers on a real :class:`~weightsync.core._state.StateMachine` built from the tables.
Requests that leave the state as it was are not drawn (self-loops make the picture
unreadable); they go into a table beside it, with the requests the state refuses.

``docs/state-machine.md`` embeds exactly :func:`render_mermaid`'s output; a test
re-renders and compares, and ``make diagram-check`` draws it with the Mermaid library.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from weightsync.core._state import (
    GENERATION_STATES,
    SUCCEEDED,
    TORE,
    VERSION_STATES,
    SessionSteps,
    StateMachine,
    UpdateSteps,
)
from weightsync.core.errors import IllegalState
from weightsync.core.snapshot import Generation


class Command(NamedTuple):
    """A request as a user sends it, and the triggers the controller fires for it."""

    route: str
    detail: str  # what distinguishes requests to the same route ("" when nothing)
    triggers: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.route}{self.detail}"


UPDATE: Final = "update_weights_from_*"

# The order here is the order of the labels on an edge and in the table.
# Updates fire what their :class:`~weightsync.core._state.UpdateSteps` list.
COMMANDS: Final[tuple[Command, ...]] = (
    Command("pause_generation", "", ("pause",)),
    Command("resume_generation", "", ("resume",)),
    Command("set_weight_version", "", ("declare",)),
    Command(UPDATE, " (weight_version)", UpdateSteps(declares=True).triggers(SUCCEEDED)),
    Command(UPDATE, "", UpdateSteps().triggers(SUCCEEDED)),
    Command(UPDATE, ", fails after writing", UpdateSteps().triggers(TORE)),
    Command(UPDATE, " (dry_run)", UpdateSteps(dry_run=True).triggers(SUCCEEDED)),
    Command("begin_weight_update", "", SessionSteps.begin),
    Command(UPDATE, " (session)", SessionSteps.update(SUCCEEDED)),
    Command(UPDATE, " (session), fails after writing", SessionSteps.update(TORE)),
    Command("end_weight_update", " (weight_version)", SessionSteps.finish(declares=True)),
    Command("end_weight_update", "", SessionSteps.finish()),
    Command("abort_weight_update", " / deadline", SessionSteps.abandon),
)

GUARDS: Final = ("allow_unpaused", "wrote")
"""The request flags an edge may need; ``wrote``: the session being finished wrote tensors."""

State = tuple[str, str]  # (version, generation)
STATES: Final[tuple[State, ...]] = tuple((v, g) for v in VERSION_STATES for g in GENERATION_STATES)
INITIAL: Final[State] = ("undeclared", Generation.RUNNING.value)


class Outcome(NamedTuple):
    dest: State | None  # None: refused
    guard: str | None = None  # the request flag the move needs
    code: str | None = None  # the error code of the refusal (without the flag, when guarded)


def outcome(state: State, command: Command) -> Outcome:
    """What ``command`` does in ``state``: where it leads, under which flag, or why it is refused."""
    refusal = ""
    for guard in (None, *GUARDS):
        machine = StateMachine(version=state[0], generation=state[1])
        try:
            machine.fire_all(command.triggers, **({guard: True} if guard else {}))
        except IllegalState as exc:
            refusal = refusal or exc.code
            continue
        if guard:
            return Outcome((machine.version, machine.generation), guard, refusal)
        return Outcome((machine.version, machine.generation))
    return Outcome(None, code=refusal)


def _node(state: State) -> str:
    return "_".join(state)


def _title(state: State) -> str:
    return f"{state[0]}, {state[1]}"


def _label(command: Command, result: Outcome) -> str:
    return f"{command.label} [{result.guard}]" if result.guard else command.label


def _diagram() -> str:
    lines = ["---", "title: worker state = version × generation", "---", "stateDiagram-v2"]
    lines += [f'  state "{_title(s)}" as {_node(s)}' for s in STATES]
    lines.append(f"  [*] --> {_node(INITIAL)}")
    grouped: dict[tuple[State, State], list[str]] = {}
    for source, dest, label in edges():
        grouped.setdefault((source, dest), []).append(label)
    for (source, dest), labels in grouped.items():
        lines.append(f"  {_node(source)} --> {_node(dest)}: {'<br/>'.join(labels)}")
    return "\n".join(lines)


def _table() -> str:
    rows = [
        "| state | keeps the state (not drawn) | refused (409, nothing changes) |",
        "|---|---|---|",
    ]
    for state in STATES:
        kept: list[str] = []
        refused: dict[str, None] = {}  # ordered, without repeats
        for command in COMMANDS:
            result = outcome(state, command)
            if result.dest == state:
                kept.append(f"`{_label(command, result)}`")
            if result.dest is None:
                refused[f"`{command.label}` (`{result.code}`)"] = None
            elif result.guard:
                refused[f"`{command.route}` without `{result.guard}` (`{result.code}`)"] = None
        rows.append(f"| {_title(state)} | {', '.join(kept) or '–'} | {', '.join(refused) or '–'} |")
    return "\n".join(rows)


def render_mermaid() -> str:
    """Return the generated part of ``docs/state-machine.md``: the product diagram as a
    Mermaid ``stateDiagram-v2`` block, then the table of requests that keep the state."""
    return f"```mermaid\n{_diagram()}\n```\n\n{_table()}\n"


def edges() -> list[tuple[State, State, str]]:
    """Every drawn edge as (source, dest, label): for tests and other renderers."""
    out: list[tuple[State, State, str]] = []
    for state in STATES:
        for command in COMMANDS:
            result = outcome(state, command)
            if result.dest is not None and result.dest != state:
                out.append((state, result.dest, _label(command, result)))
    return out
