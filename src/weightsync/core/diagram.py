"""Render the state tables of ``_state.py`` as Mermaid, with ``transitions``' GraphMachine.

``docs/state-machine.md`` embeds exactly this output; a test re-renders and compares.
"""

from __future__ import annotations

from typing import Any

from ._state import (
    GENERATION_STATES,
    GENERATION_TABLE,
    VERSION_STATES,
    VERSION_TABLE,
    Row,
    machine_kwargs,
)


def _render(title: str, table: tuple[Row, ...], states: tuple[str, ...], initial: str) -> str:
    # Imported here: the graph extension is only needed to draw, never to run the machine.
    from transitions.extensions import GraphMachine

    class _Model:
        pass

    model: Any = _Model()
    GraphMachine(
        model=model,
        title=title,
        graph_engine="mermaid",
        show_conditions=True,
        **machine_kwargs(table, states, initial),
    )
    text: str = model.get_graph().draw(None)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def render_mermaid() -> str:
    """Return both machines (generation, then version) as Mermaid ``stateDiagram-v2`` blocks."""
    blocks = [
        _render("generation", GENERATION_TABLE, GENERATION_STATES, "running"),
        _render("version", VERSION_TABLE, VERSION_STATES, "undeclared"),
    ]
    return "\n\n".join(f"```mermaid\n{b}\n```" for b in blocks) + "\n"
