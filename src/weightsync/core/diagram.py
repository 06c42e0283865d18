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
    KV_STATES,
    SUCCEEDED,
    TORE,
    VERSION_STATES,
    WEIGHTS_STATES,
    MemorySteps,
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
    Mermaid ``stateDiagram-v2`` block, then the table of requests that keep the state; then
    the memory parts' diagram and table (:func:`memory_edges`)."""
    memory = f"```mermaid\n{_memory_diagram()}\n```\n\n{_memory_table()}\n"
    return f"```mermaid\n{_diagram()}\n```\n\n{_table()}\n\n{memory}"


# The memory parts (weights × kv_cache), drawn for a paused worker: memory is released only
# while paused, and what it refuses (resume, an update) is the point of drawing it.
MEMORY_COMMANDS: Final[tuple[Command, ...]] = (
    Command("release_memory", " (offload) · vLLM sleep level=1", MemorySteps.release("offload", True)),
    Command("release_memory", " (discard) · vLLM sleep level=2, SGLang all tags", MemorySteps.release("discard", True)),
    Command("release_memory", " (discard, kv kept) · SGLang weights", MemorySteps.release("discard", False)),
    Command("release_memory", " (kv only) · SGLang kv_cache", MemorySteps.release(None, True)),
    Command("resume_memory", "", MemorySteps.restore(True, True)),
    Command("resume_memory", " (weights)", MemorySteps.restore(True, False)),
    Command("resume_memory", " (kv_cache)", MemorySteps.restore(False, True)),
    Command(UPDATE, " (every discarded tensor)", UpdateSteps(restores=True).triggers(SUCCEEDED)),
    Command(UPDATE, "", UpdateSteps().triggers(SUCCEEDED)),
    Command("begin_weight_update", "", SessionSteps.begin),
    Command("resume_generation", "", ("resume",)),
)  # fmt: skip
MemoryState = tuple[str, str]  # (weights, kv_cache)
MEMORY_STATES: Final[tuple[MemoryState, ...]] = tuple((w, k) for w in WEIGHTS_STATES for k in KV_STATES)


def memory_outcome(state: MemoryState, command: Command) -> MemoryState | str:
    """Where ``command`` leads a paused worker whose memory is ``state``, or the refusal code."""
    machine = StateMachine(generation=Generation.PAUSED.value, weights=state[0], kv_cache=state[1])
    try:
        machine.fire_all(command.triggers)
    except IllegalState as exc:
        return exc.code
    return machine.weights, machine.kv_cache


def memory_edges() -> list[tuple[MemoryState, MemoryState, str]]:
    """Every drawn edge of the memory diagram as (source, dest, label)."""
    out: list[tuple[MemoryState, MemoryState, str]] = []
    for state in MEMORY_STATES:
        for command in MEMORY_COMMANDS:
            dest = memory_outcome(state, command)
            if isinstance(dest, tuple) and dest != state:
                out.append((state, dest, command.label))
    return out


def _memory_diagram() -> str:
    lines = ["---", "title: memory = weights × kv_cache (a paused worker)", "---", "stateDiagram-v2"]
    lines += [f'  state "weights {w}, kv_cache {k}" as w_{w}_kv_{k}' for w, k in MEMORY_STATES]
    lines.append("  [*] --> w_resident_kv_resident")
    grouped: dict[tuple[MemoryState, MemoryState], list[str]] = {}
    for source, dest, label in memory_edges():
        grouped.setdefault((source, dest), []).append(label)
    for ((sw, sk), (dw, dk)), labels in grouped.items():
        lines.append(f"  w_{sw}_kv_{sk} --> w_{dw}_kv_{dk}: {'<br/>'.join(labels)}")
    return "\n".join(lines)


def _memory_table() -> str:
    rows = ["| memory | keeps the state (not drawn) | refused (409, nothing changes) |", "|---|---|---|"]
    for state in MEMORY_STATES:
        results = [(command, memory_outcome(state, command)) for command in MEMORY_COMMANDS]
        kept = [f"`{c.label}`" for c, r in results if r == state]
        refused = dict.fromkeys(f"`{c.label}` (`{r}`)" for c, r in results if isinstance(r, str))
        title = f"weights {state[0]}, kv_cache {state[1]}"
        rows.append(f"| {title} | {', '.join(kept) or '–'} | {', '.join(refused) or '–'} |")
    return "\n".join(rows)


def edges() -> list[tuple[State, State, str]]:
    """Every drawn edge as (source, dest, label): for tests and other renderers."""
    out: list[tuple[State, State, str]] = []
    for state in STATES:
        for command in COMMANDS:
            result = outcome(state, command)
            if result.dest is not None and result.dest != state:
                out.append((state, result.dest, _label(command, result)))
    return out
