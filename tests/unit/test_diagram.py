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
    from weightsync.core._state import (
        GENERATION_STATES,
        GENERATION_TRIGGERS,
        KV_STATES,
        MEMORY_TRIGGERS,
        VERSION_TRIGGERS,
        WEIGHTS_STATES,
    )

    prose = DOC.read_text().split("<!-- END GENERATED DIAGRAM -->")[1]
    words = (*GENERATION_TRIGGERS, *VERSION_TRIGGERS, *MEMORY_TRIGGERS, *WEIGHTS_STATES, *KV_STATES)
    for word in (*words, *GENERATION_STATES, "allow_unpaused"):
        assert f"**{word}**" in prose or f"`{word}`" in prose, word


def mermaid_block() -> str:
    match = re.search(r"```mermaid\n(.*?)```", render_mermaid(), re.S)
    assert match
    return match.group(1)


def test_diagram_is_one_product_machine_with_a_title_front_matter() -> None:
    block = mermaid_block()
    assert block.startswith("---\ntitle: "), block[:40]
    assert block.count("stateDiagram-v2") == 1
    for version in ("undeclared", "declared"):
        for generation in ("running", "paused", "torn"):
            assert f'state "{version}, {generation}" as {version}_{generation}' in block


def test_diagram_has_no_self_loops_and_no_active_state_styling() -> None:
    block = mermaid_block()
    assert "classDef" not in block and "Class " not in block and "class " not in block
    for line in block.splitlines():
        if "-->" in line and not line.strip().startswith("[*]"):
            source, dest = line.split(":")[0].split("-->")
            assert source.strip() != dest.strip(), line


def test_edges_are_the_requests_a_user_sends() -> None:
    from weightsync.core.diagram import edges

    drawn = {(s, d): label for s, d, label in edges()}
    # An update carrying weight_version moves both parts at once.
    assert drawn[("undeclared", "torn"), ("declared", "paused")] == "update_weights_from_* (weight_version)"
    # A torn worker keeps its label; declaring while torn keeps it torn.
    assert drawn[("undeclared", "torn"), ("declared", "torn")] == "set_weight_version"
    assert "[allow_unpaused]" in drawn[("declared", "running"), ("declared", "torn")]
    assert not any(s == ("declared", "torn") and d[1] == "running" for s, d in drawn)
    assert not any(s[0] == "declared" and d[0] == "undeclared" for s, d in drawn)


def test_table_lists_what_each_state_keeps_and_refuses() -> None:
    table = "".join(render_mermaid().split("```")[2::2])
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "`resume_generation` (`weights_torn`)" in rows["declared, torn"]
    assert "without `allow_unpaused` (`not_paused`)" in rows["undeclared, running"]
    assert "`pause_generation`" in rows["declared, paused"].split("|")[2]


def test_a_dry_run_keeps_every_state_and_is_listed_beside_the_diagram() -> None:
    from weightsync.core.diagram import STATES, _title, edges

    assert not any("dry_run" in label for _, _, label in edges())  # a self-loop: never drawn
    table = render_mermaid().split("```")[2]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2] for line in table.splitlines() if line.startswith("| ")
    }
    for state in STATES:
        assert "`update_weights_from_* (dry_run)`" in rows[_title(state)], state


def test_the_memory_diagram_draws_release_and_restore_and_refuses_resume_without_weights() -> None:
    from weightsync.core.diagram import memory_edges

    drawn = {(s, d): label for s, d, label in memory_edges()}
    full = ("resident", "resident")
    assert "vLLM sleep level=2" in drawn[full, ("discarded", "released")]
    assert "vLLM sleep level=1" in drawn[full, ("offloaded", "released")]
    # a wake gives discarded weights memory but no content: only an update makes them resident
    assert drawn[("discarded", "released"), ("discarded", "resident")].startswith("resume_memory")
    assert drawn[("discarded", "resident"), full] == "update_weights_from_* (every discarded tensor)"
    assert drawn[("offloaded", "released"), full] == "resume_memory"
    table = render_mermaid().split("```")[-1]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "`resume_generation` (`weights_released`)" in rows["weights discarded, kv_cache resident"]
    assert "`update_weights_from_*` (`weights_offloaded`)" in rows["weights offloaded, kv_cache released"]
    assert "`resume_generation` (`kv_released`)" in rows["weights resident, kv_cache released"]
