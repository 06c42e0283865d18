"""The adapter-slot tables, checked twice (a hand-written matrix and the ``transitions``
machines built from the same rows), and their diagram, which docs/state-machine.md embeds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transitions import Machine

from weightsync.core.errors import IllegalState, NotFound
from weightsync.core.tables import machine_kwargs, try_fire
from weightsync.lora._slots import (
    RESIDENCY_STATES,
    RESIDENCY_TABLE,
    TRIGGERS,
    VERSION_STATES,
    VERSION_TABLE,
    SlotConditions,
    moved,
)
from weightsync.lora.diagram import edges, render_mermaid, states

DOC = Path(__file__).resolve().parents[3] / "docs" / "state-machine.md"

# (trigger, room) per residency -> destination, or the refusal code.  Written by hand from the
# module docstring of lora/_slots.py, not derived from the table.
A, L, R, P, E = "absent", "loading", "resident", "replacing", "evicting"
_BUSY = {L: "adapter_busy", P: "adapter_busy", E: "adapter_busy"}
_ILLEGAL = "illegal_state"
RESIDENCY: dict[str, dict[str, str]] = {
    "begin_load": {A: "adapter_slots_full", R: P, **_BUSY},
    "load_succeeded": {A: _ILLEGAL, L: R, R: _ILLEGAL, P: R, E: _ILLEGAL},
    "load_refused": {A: _ILLEGAL, L: A, R: _ILLEGAL, P: R, E: _ILLEGAL},
    "declare": {A: "adapter_not_found", R: R, **_BUSY},
    "begin_evict": {A: "adapter_not_found", R: E, **_BUSY},
    "evict_done": {A: _ILLEGAL, L: _ILLEGAL, R: _ILLEGAL, P: _ILLEGAL, E: A},
    "evict_refused": {A: _ILLEGAL, L: _ILLEGAL, R: _ILLEGAL, P: _ILLEGAL, E: R},
}
WITH_ROOM = {("begin_load", A): L}


@pytest.mark.parametrize("room", [False, True])
@pytest.mark.parametrize("trigger", sorted(RESIDENCY))
@pytest.mark.parametrize("residency", RESIDENCY_STATES)
def test_every_residency_and_trigger_is_as_the_matrix_says(residency: str, trigger: str, room: bool) -> None:
    want = (
        WITH_ROOM.get((trigger, residency), RESIDENCY[trigger][residency])
        if room
        else RESIDENCY[trigger][residency]
    )
    states = {"residency": residency, "version": "undeclared"}
    if want in RESIDENCY_STATES:
        assert moved(trigger, states, flags={"room": room})["residency"] == want
    else:
        with pytest.raises((IllegalState, NotFound)) as err:
            moved(trigger, states, flags={"room": room})
        assert err.value.code == want
        assert isinstance(err.value, NotFound) == (want == "adapter_not_found")


def test_the_matrix_names_every_trigger_of_the_tables() -> None:
    assert set(RESIDENCY) == set(TRIGGERS)


def test_declaring_and_forgetting_move_the_version_part() -> None:
    for version in VERSION_STATES:
        assert moved("declare", {"residency": R, "version": version})["version"] == "declared"
        assert moved("evict_done", {"residency": E, "version": version}) == {
            "residency": A,
            "version": "undeclared",
        }


class _Model(SlotConditions):
    state: str


@pytest.mark.parametrize("room", [False, True])
@pytest.mark.parametrize("residency", RESIDENCY_STATES)
def test_the_transitions_machine_of_the_residency_rows_agrees_with_the_matrix(
    residency: str, room: bool
) -> None:
    for trigger in sorted({row.trigger for row in RESIDENCY_TABLE}):
        model = _Model()
        Machine(model=model, **machine_kwargs(RESIDENCY_TABLE, RESIDENCY_STATES, residency))
        want = (
            WITH_ROOM.get((trigger, residency), RESIDENCY[trigger][residency])
            if room
            else RESIDENCY[trigger][residency]
        )
        fired = try_fire(model, trigger, room=room)
        assert fired == (want in RESIDENCY_STATES), (trigger, residency, room)
        assert model.state == (want if fired else residency)


def test_the_transitions_machine_of_the_version_rows_agrees() -> None:
    for version in VERSION_STATES:
        for trigger, want in (("declare", "declared"), ("evict_done", "undeclared")):
            model = _Model()
            Machine(model=model, **machine_kwargs(VERSION_TABLE, VERSION_STATES, version))
            assert try_fire(model, trigger) and model.state == want


def committed() -> str:
    text = DOC.read_text()
    match = re.search(
        r"<!-- BEGIN GENERATED ADAPTER SLOTS.*?-->\n(.*)<!-- END GENERATED ADAPTER SLOTS -->", text, re.S
    )
    assert match, "docs/state-machine.md lost its adapter-slot markers"
    return match.group(1)


def test_the_committed_slot_diagram_matches_a_fresh_render() -> None:
    assert committed() == render_mermaid(), "re-render weightsync.lora.diagram into docs/state-machine.md"


def test_the_diagram_draws_each_reachable_state_and_no_self_loop() -> None:
    assert set(states()) == {(r, v) for r in RESIDENCY_STATES for v in VERSION_STATES} - {
        ("absent", "declared"),
        ("loading", "declared"),
    }
    drawn = {(s, d) for s, d, _ in edges()}
    assert all(s != d for s, d in drawn)
    assert (("replacing", "declared"), ("resident", "declared")) in drawn  # a failed replace keeps the old
    assert (("evicting", "declared"), ("absent", "undeclared")) in drawn  # an unloaded slot is forgotten
    assert not any(s[1] == "declared" and d[1] == "undeclared" and d[0] != "absent" for s, d in drawn)


def test_every_slot_trigger_and_state_is_explained_in_prose() -> None:
    prose = DOC.read_text().replace(committed(), "")
    for word in (*TRIGGERS, *RESIDENCY_STATES, "room"):
        assert f"**{word}**" in prose or f"`{word}`" in prose, word
