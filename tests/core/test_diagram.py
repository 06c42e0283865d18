from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from weightsync.core.diagram import render_mermaid

DOC = Path(__file__).resolve().parents[2] / "docs" / "state-machine.md"


def committed_diagram() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- BEGIN GENERATED DIAGRAM.*?-->\n(.*)<!-- END GENERATED DIAGRAM -->", text, re.S)
    assert match, "docs/state-machine.md lost its generated-diagram markers"
    return match.group(1)


def test_committed_diagram_matches_a_fresh_render() -> None:
    assert committed_diagram() == render_mermaid(), "run `weightsync diagram` and paste it into the doc"


def test_cli_prints_the_same_diagram() -> None:
    out = subprocess.run([sys.executable, "-m", "weightsync.cli", "diagram"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == render_mermaid()


def test_every_trigger_is_explained_in_prose() -> None:
    from weightsync.core._state import GENERATION_STATES, GENERATION_TRIGGERS, VERSION_TRIGGERS

    prose = DOC.read_text().split("<!-- END GENERATED DIAGRAM -->")[1]
    for word in (*GENERATION_TRIGGERS, *VERSION_TRIGGERS, *GENERATION_STATES, "allow_unpaused"):
        assert f"**{word}**" in prose or f"`{word}`" in prose, word
