"""The transaction table, checked twice: a hand-written matrix and a hypothesis totality test."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.core.errors import IllegalState
from weightsync.fleet._state import STATES, TERMINAL, TRIGGERS, TransactionMachine

pytestmark = pytest.mark.unit

# trigger -> {source phase: destination}; every pair not listed is refused.
# Written by hand from docs/fleet.md, not derived from the table.
MATRIX = {
    "begin": {"idle": "preparing"},
    "refuse": {"preparing": "aborted"},
    "prepared": {"preparing": "applying"},
    "applied": {"applying": "verifying"},
    "verified": {"verifying": "committing"},
    "declared": {"committing": "resuming"},
    "next_batch": {"resuming": "applying"},
    "resumed": {"resuming": "committed"},
    "resumed_fenced": {"resuming": "fenced"},
    "fail": {"applying": "rolling_back", "verifying": "rolling_back", "committing": "rolling_back"},
    "rollback_done": {"rolling_back": "rolled_back"},
    "rollback_incomplete": {"rolling_back": "rollback_failed"},
    "recover_abort": {"preparing": "aborted"},
    "recover_forward": {"resuming": "resuming"},
    "recover_retry": {"applying": "applying", "verifying": "applying", "committing": "applying"},
    "recover_rollback": {
        "applying": "rolling_back",
        "verifying": "rolling_back",
        "committing": "rolling_back",
        "rolling_back": "rolling_back",
    },
}


def test_matrix_names_every_trigger_of_the_table() -> None:
    assert set(MATRIX) == set(TRIGGERS)


@pytest.mark.parametrize("phase", STATES)
@pytest.mark.parametrize("trigger", sorted(MATRIX))
def test_matrix(phase: str, trigger: str) -> None:
    m = TransactionMachine(phase)
    expected = MATRIX[trigger].get(phase)
    if expected is None:
        with pytest.raises(IllegalState) as err:
            m.fire(trigger)
        assert err.value.code == "illegal_phase" and err.value.http_status == 409
        assert m.phase == phase
    else:
        assert m.fire(trigger) == expected == m.phase


def test_terminal_phases_have_no_way_out() -> None:
    for phase in TERMINAL:
        assert all(phase not in sources for sources in MATRIX.values())


def test_every_phase_is_reachable_from_idle() -> None:
    seen, todo = {"idle"}, ["idle"]
    while todo:
        phase = todo.pop()
        for sources in MATRIX.values():
            dest = sources.get(phase)
            if dest and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    assert seen == set(STATES)


def test_unknown_trigger_and_phase_are_programming_errors() -> None:
    with pytest.raises(ValueError, match="unknown trigger"):
        TransactionMachine().fire("explode")
    with pytest.raises(ValueError, match="unknown phase"):
        TransactionMachine("limbo")


@given(st.sampled_from(STATES), st.lists(st.sampled_from(TRIGGERS), max_size=8))
def test_totality_every_sequence_moves_legally_or_raises_unchanged(start: str, triggers: list[str]) -> None:
    m = TransactionMachine(start)
    for trigger in triggers:
        before = m.phase
        try:
            after = m.fire(trigger)
        except IllegalState:
            assert m.phase == before and MATRIX[trigger].get(before) is None
        else:
            assert after == MATRIX[trigger][before] and after in STATES
            if before in TERMINAL:
                pytest.fail(f"{trigger} left terminal phase {before}")
