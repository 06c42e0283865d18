"""Draw the fleet transaction from ``_state.TABLE`` as Mermaid.

Every row is one edge (rows that share source and destination share an edge, labels
joined); terminal phases point to ``[*]``.  ``docs/fleet.md`` embeds exactly
:func:`render_mermaid`'s output and a test re-renders and compares.
"""

from __future__ import annotations

from weightsync.fleet._state import INITIAL, STATES, TABLE, TERMINAL


def render_mermaid() -> str:
    """Return the transaction machine as one Mermaid ``stateDiagram-v2`` block."""
    lines = ["---", "title: fleet transaction", "---", "stateDiagram-v2"]
    lines.append(f"  [*] --> {INITIAL}")
    grouped: dict[tuple[str, str], list[str]] = {}
    for row in TABLE:
        grouped.setdefault((row.source, row.dest), []).append(row.trigger)
    for (source, dest), triggers in grouped.items():
        lines.append(f"  {source} --> {dest}: {'<br/>'.join(triggers)}")
    lines += [f"  {state} --> [*]" for state in STATES if state in TERMINAL]
    return "```mermaid\n" + "\n".join(lines) + "\n```\n"
