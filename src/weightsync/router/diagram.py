"""Draw a worker's routing state from ``_state.TABLE`` as Mermaid.

Every row that moves the worker is one edge (rows sharing source and destination share an
edge, labels joined).  Rows that leave the state as it is are not drawn; they go into the
table under the diagram, with the triggers a state has no row for.  ``docs/router.md``
embeds exactly :func:`render_mermaid`'s output and a test re-renders and compares.
"""

from __future__ import annotations

from weightsync.router._state import INITIAL, STATES, TABLE, TRIGGERS


def _diagram() -> str:
    lines = ["---", "title: a worker's routing state", "---", "stateDiagram-v2"]
    lines.append(f"  [*] --> {INITIAL}")
    grouped: dict[tuple[str, str], list[str]] = {}
    for row in TABLE:
        if row.source != row.dest:
            grouped.setdefault((row.source, row.dest), []).append(row.trigger)
    for (source, dest), triggers in grouped.items():
        lines.append(f"  {source} --> {dest}: {'<br/>'.join(triggers)}")
    return "\n".join(lines)


def _table() -> str:
    rows = ["| state | keeps the state (not drawn) | no row (nothing changes) |", "|---|---|---|"]
    for state in STATES:
        kept = [f"`{r.trigger}`" for r in TABLE if r.source == state and r.dest == state]
        moved = {r.trigger for r in TABLE if r.source == state}
        missing = [f"`{t}`" for t in TRIGGERS if t not in moved]
        rows.append(f"| {state} | {', '.join(kept) or '–'} | {', '.join(missing) or '–'} |")
    return "\n".join(rows)


def render_mermaid() -> str:
    """The generated part of ``docs/router.md``: the diagram as a Mermaid ``stateDiagram-v2``
    block, then the table of triggers that keep each state or do not apply to it."""
    return f"```mermaid\n{_diagram()}\n```\n\n{_table()}\n"
