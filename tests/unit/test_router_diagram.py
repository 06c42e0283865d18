"""docs/router.md embeds the routing diagram as rendered from the table, and explains it."""

from __future__ import annotations

import re
from pathlib import Path

from weightsync.router._state import STATES, TRIGGERS
from weightsync.router.diagram import render_mermaid

DOC = Path(__file__).resolve().parents[2] / "docs" / "router.md"


def committed_diagram() -> str:
    match = re.search(
        r"<!-- BEGIN GENERATED DIAGRAM.*?-->\n(.*)<!-- END GENERATED DIAGRAM -->", DOC.read_text(), re.S
    )
    assert match, "docs/router.md lost its generated-diagram markers"
    return match.group(1)


def test_committed_router_diagram_matches_a_fresh_render() -> None:
    assert committed_diagram() == render_mermaid(), "re-render weightsync.router.diagram into docs/router.md"


def test_diagram_draws_every_state_and_trigger() -> None:
    text = render_mermaid()
    for state in STATES:
        assert f" {state} " in text or f" {state}:" in text, state
    for trigger in TRIGGERS:
        assert trigger in text, trigger


def test_every_state_and_trigger_is_explained_in_prose() -> None:
    prose = DOC.read_text().replace(committed_diagram(), "")
    for word in (*TRIGGERS, *STATES):
        assert f"`{word}`" in prose, word
