from __future__ import annotations

import re
from pathlib import Path

import pytest

from weightsync.fleet._state import STATES, TRIGGERS
from weightsync.fleet.diagram import render_mermaid

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "fleet.md"


def committed_diagram() -> str:
    match = re.search(
        r"<!-- BEGIN GENERATED DIAGRAM.*?-->\n(.*)<!-- END GENERATED DIAGRAM -->", DOC.read_text(), re.S
    )
    assert match, "docs/fleet.md lost its generated-diagram markers"
    return match.group(1)


def test_committed_fleet_diagram_matches_a_fresh_render() -> None:
    assert committed_diagram() == render_mermaid(), "re-render weightsync.fleet.diagram into docs/fleet.md"


def test_diagram_draws_every_row_and_phase() -> None:
    text = render_mermaid()
    for phase in STATES:
        assert f" {phase} " in text or f" {phase}\n" in text, phase
    for trigger in TRIGGERS:
        assert trigger in text, trigger


def test_every_trigger_and_phase_is_explained_in_prose() -> None:
    prose = DOC.read_text().split("<!-- END GENERATED DIAGRAM -->")[1]
    for word in (*TRIGGERS, *STATES):
        assert f"`{word}`" in prose, word
