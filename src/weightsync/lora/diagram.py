"""Draw one adapter slot (residency × version) from the tables of :mod:`weightsync.lora._slots`.

A slot's command is two steps with a state between them that reads can see (``loading``,
``replacing``, ``evicting``), so each edge here is one step of a command, found by firing its
triggers from every state the slot can reach.  The table beside it lists, per state, the
commands a user may send that the state refuses, and why (the second steps are the worker's
own, never refused in a state a first step leads to).

``docs/state-machine.md`` embeds exactly :func:`render_mermaid`'s output, below the worker's
own diagram; a test re-renders and compares.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from weightsync.core.errors import WeightSyncError
from weightsync.lora._slots import REFUSED, SUCCEEDED, LoadSteps, UnloadSteps, moved_all


class Step(NamedTuple):
    """One step of a slot command as a user sees it, and the triggers it fires."""

    label: str
    triggers: tuple[str, ...]


LOAD: Final = "load_lora_adapter"
UNLOAD: Final = "unload_lora_adapter"
STEPS: Final[tuple[Step, ...]] = (
    Step(f"{LOAD} begins", LoadSteps.begin),
    Step(f"{LOAD} served (weight_version, or the manifest's)", LoadSteps.ending(SUCCEEDED, declares=True)),
    Step(f"{LOAD} served (no version)", LoadSteps.ending(SUCCEEDED)),
    Step(f"{LOAD} refused or failed", LoadSteps.ending(REFUSED)),
    Step(f"{UNLOAD} begins", UnloadSteps.begin),
    Step(f"{UNLOAD} done", UnloadSteps.done),
    Step(f"{UNLOAD} failed", UnloadSteps.refused),
)

STARTS: Final = (*LoadSteps.begin, *UnloadSteps.begin)
"""The triggers a user's command starts with (the others are the worker's own steps)."""

GUARDS: Final = ("room",)
"""The flags a step may need: ``room``, a free slot (``serve --max-loras``)."""

State = tuple[str, str]  # (residency, version)
INITIAL: Final[State] = ("absent", "undeclared")


class Outcome(NamedTuple):
    dest: State | None  # None: refused
    guard: str | None = None
    code: str | None = None


def outcome(state: State, step: Step) -> Outcome:
    """Where ``step`` leads from ``state``: the state, under which flag, or why it is refused."""
    refusal = ""
    for guard in (None, *GUARDS):
        try:
            flags = {guard: True} if guard else {}
            states = moved_all(step.triggers, {"residency": state[0], "version": state[1]}, flags=flags)
        except WeightSyncError as exc:
            refusal = refusal or exc.code
            continue
        return Outcome((states["residency"], states["version"]), guard, refusal if guard else None)
    return Outcome(None, code=refusal)


def states() -> tuple[State, ...]:
    """Every state a slot can reach from :data:`INITIAL`, in the order first reached."""
    seen = [INITIAL]
    for state in seen:
        for step in STEPS:
            dest = outcome(state, step).dest
            if dest is not None and dest not in seen:
                seen.append(dest)
    return tuple(seen)


def _label(step: Step, result: Outcome) -> str:
    return f"{step.label} [{result.guard}]" if result.guard else step.label


def edges() -> list[tuple[State, State, str]]:
    """Every drawn edge as (source, dest, label)."""
    out = []
    for state in states():
        for step in STEPS:
            result = outcome(state, step)
            if result.dest is not None and result.dest != state:
                out.append((state, result.dest, _label(step, result)))
    return out


def _node(state: State) -> str:
    return "slot_" + "_".join(state)


def render_mermaid() -> str:
    """The generated part of ``docs/state-machine.md`` for adapter slots: the diagram as a
    Mermaid ``stateDiagram-v2`` block, then the table of steps that keep or are refused."""
    lines = ["---", "title: one LoRA adapter slot = residency × version", "---", "stateDiagram-v2"]
    lines += [f'  state "{r}, {v}" as {_node((r, v))}' for r, v in states()]
    lines.append(f"  [*] --> {_node(INITIAL)}")
    grouped: dict[tuple[State, State], list[str]] = {}
    for source, dest, label in edges():
        grouped.setdefault((source, dest), []).append(label)
    for (source, dest), labels in grouped.items():
        lines.append(f"  {_node(source)} --> {_node(dest)}: {'<br/>'.join(labels)}")
    rows = ["| slot | refused (nothing changes) |", "|---|---|"]
    for state in states():
        refused = []
        for step in STEPS:
            result = outcome(state, step)
            if step.triggers[0] not in STARTS:
                continue
            if result.dest is None:
                refused.append(f"`{step.label}` (`{result.code}`)")
            elif result.guard:
                refused.append(f"`{step.label}` without `{result.guard}` (`{result.code}`)")
        rows.append(f"| {state[0]}, {state[1]} | {', '.join(refused) or '–'} |")
    return "```mermaid\n" + "\n".join(lines) + "\n```\n\n" + "\n".join(rows) + "\n"
