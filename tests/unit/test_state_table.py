"""The state table, checked twice: a hand-written matrix and a hypothesis totality test."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transitions import Machine

from weightsync.core._state import (
    GENERATION_STATES,
    GENERATION_TABLE,
    GENERATION_TRIGGERS,
    KV_STATES,
    KV_TABLE,
    MEMORY_TRIGGERS,
    PARTS,
    VERSION_STATES,
    VERSION_TABLE,
    VERSION_TRIGGERS,
    WEIGHTS_STATES,
    WEIGHTS_TABLE,
    ConditionModel,
    StateMachine,
    _index,
    move,
    parts_of,
)
from weightsync.core.errors import IllegalState
from weightsync.core.tables import Row, machine_kwargs, triggers, try_fire

# (trigger, guard) per generation state -> destination, or the refusal code.  The guard is
# the request flag set when firing (None: no flag).  Written by hand from DESIGN.md §2 and
# §11, not derived from the table.
R, P, T, U, UT = "running", "paused", "torn", "updating", "updating_torn"
_SESSION_OPEN = {U: "session_open", UT: "session_open"}
_NO_SESSION = {R: "no_session", P: "no_session", T: "no_session"}
_ROWS = {
    "pause": {R: P, P: P, T: T, U: U, UT: UT},
    "resume": {R: R, P: R, T: "weights_torn", **_SESSION_OPEN},
    "begin_update": {R: "not_paused", P: P, T: T, **_SESSION_OPEN},
    "update_succeeded": {R: R, P: P, T: P, U: "illegal_state", UT: "illegal_state"},
    "update_tore": {R: T, P: T, T: T, U: "illegal_state", UT: "illegal_state"},
    # a dry run is legal in every state, allow_unpaused or not, and moves nothing
    "dry_run": {R: R, P: P, T: T, U: U, UT: UT},
    "begin_session": {R: "not_paused", P: U, T: UT, **_SESSION_OPEN},
    "session_update": {**_NO_SESSION, U: U, UT: UT},
    "session_wrote": {**_NO_SESSION, U: UT, UT: UT},
    "finish_session": {**_NO_SESSION, U: P, UT: "weights_torn"},
    "abandon_session": {**_NO_SESSION, U: P, UT: T},
    # memory is released only while paused (or torn); a dialect pauses a serving worker first
    "release_memory": {R: "not_paused", P: P, T: T, **_SESSION_OPEN},
}
GENERATION_MATRIX: dict[tuple[str, str | None], dict[str, str]] = {
    **{(t, None): row for t, row in _ROWS.items()},
    **{(t, "allow_unpaused"): row for t, row in _ROWS.items()},
    **{(t, "wrote"): row for t, row in _ROWS.items()},
}
GENERATION_MATRIX[("begin_update", "allow_unpaused")] = {R: R, P: P, T: T, **_SESSION_OPEN}
GENERATION_MATRIX[("finish_session", "wrote")] = {**_NO_SESSION, U: P, UT: P}
VERSION_MATRIX = {"declare": {"undeclared": "declared", "declared": "declared"}}

# The memory parts (DESIGN.md §14), by hand: offloaded weights come back as they were, discarded
# ones come back only through an update that rewrote them all (weights_loaded); resume needs
# both parts resident, an update or a session needs weights that are not offloaded.
RS, OF, DC, RL = "resident", "offloaded", "discarded", "released"
WEIGHTS_MATRIX = {
    "offload_weights": {RS: OF, OF: OF, DC: DC},
    "discard_weights": {RS: DC, OF: DC, DC: DC},
    "restore_weights": {RS: RS, OF: RS, DC: DC},
    "weights_loaded": {RS: RS, OF: "illegal_state", DC: RS},
    "resume": {RS: RS, OF: "weights_offloaded", DC: "weights_released"},
    "begin_update": {RS: RS, OF: "weights_offloaded", DC: DC},
    "begin_session": {RS: RS, OF: "weights_offloaded", DC: DC},
}
KV_MATRIX = {
    "release_kv": {RS: RL, RL: RL},
    "restore_kv": {RS: RS, RL: RS},
    "resume": {RS: RS, RL: "kv_released"},
}
MATRICES = {"generation": GENERATION_MATRIX, "weights": WEIGHTS_MATRIX, "kv_cache": KV_MATRIX}


def test_matrix_covers_every_state_and_trigger() -> None:
    assert {t for t, _ in GENERATION_MATRIX} == set(GENERATION_TRIGGERS)
    assert set(WEIGHTS_MATRIX) == set(triggers(WEIGHTS_TABLE)) and set(WEIGHTS_STATES) == {RS, OF, DC}
    assert set(KV_MATRIX) == set(triggers(KV_TABLE)) and set(KV_STATES) == {RS, RL}
    for memory_row in [*WEIGHTS_MATRIX.values(), *KV_MATRIX.values()]:
        assert set(memory_row) in (set(WEIGHTS_STATES), set(KV_STATES))
    assert set(GENERATION_STATES) == {R, P, T, U, UT}
    assert set(VERSION_MATRIX) == set(VERSION_TRIGGERS)
    for row in GENERATION_MATRIX.values():
        assert set(row) == set(GENERATION_STATES)


@pytest.mark.parametrize("state", GENERATION_STATES)
@pytest.mark.parametrize(("trigger", "guard"), list(GENERATION_MATRIX))
def test_generation_matrix(state: str, trigger: str, guard: str | None) -> None:
    m = StateMachine(generation=state)
    flags = {guard: True} if guard else {}
    expected = GENERATION_MATRIX[(trigger, guard)][state]
    if expected in GENERATION_STATES:
        m.check(trigger, **flags)
        m.fire(trigger, **flags)
        assert m.generation == expected
    else:
        with pytest.raises(IllegalState) as err:
            m.check(trigger, **flags)
        assert err.value.code == expected
        with pytest.raises(IllegalState) as err:
            m.fire(trigger, **flags)
        assert err.value.code == expected and err.value.http_status == 409
        assert m.generation == state
    assert m.version == "undeclared"


@pytest.mark.parametrize(
    ("part", "state", "trigger"),
    [("weights", s, t) for t, row in WEIGHTS_MATRIX.items() for s in row]
    + [("kv_cache", s, t) for t, row in KV_MATRIX.items() for s in row],
)
def test_memory_matrix(part: str, state: str, trigger: str) -> None:
    # paused: every trigger of the memory tables is legal for the generation part there
    m = StateMachine(generation=P, **{part: state})
    expected = MATRICES[part][trigger][state]
    if expected in (*WEIGHTS_STATES, *KV_STATES):
        m.check(trigger)
        m.fire(trigger)
        assert getattr(m, part) == expected
    else:
        with pytest.raises(IllegalState) as err:
            m.fire(trigger)
        assert err.value.code == expected and err.value.http_status == 409
        assert m.states == {**StateMachine(generation=P).states, part: state}


def test_a_trigger_of_two_parts_moves_both_or_neither() -> None:
    m = StateMachine(generation=P, weights=DC)
    with pytest.raises(IllegalState) as err:
        m.fire("resume")
    assert err.value.code == "weights_released" and m.generation == P
    m = StateMachine(generation=R)
    with pytest.raises(IllegalState) as err:
        m.fire("release_memory")
    assert err.value.code == "not_paused"
    assert parts_of("resume") == ("generation", "weights", "kv_cache")


@pytest.mark.parametrize("state", VERSION_STATES)
def test_version_matrix(state: str) -> None:
    m = StateMachine(version=state)
    m.fire("declare")
    assert m.version == VERSION_MATRIX["declare"][state]
    assert m.generation == "running"


@pytest.mark.parametrize("state", [U, UT])
@pytest.mark.parametrize("version", VERSION_STATES)
def test_a_declaration_is_refused_while_a_session_is_open(state: str, version: str) -> None:
    m = StateMachine(generation=state, version=version)
    with pytest.raises(IllegalState) as err:
        m.check("declare")
    assert err.value.code == "session_open"
    with pytest.raises(IllegalState) as err:
        m.fire("declare")
    assert err.value.code == "session_open" and (m.generation, m.version) == (state, version)


def test_unknown_trigger_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown trigger"):
        StateMachine().fire("explode")


def transitions_model(table: tuple[Row, ...], states: tuple[str, ...], initial: str) -> Any:
    model = ConditionModel()
    Machine(model=model, **machine_kwargs(table, states, initial))
    return model


def test_no_automatic_transitions_exist() -> None:
    assert not hasattr(transitions_model(GENERATION_TABLE, GENERATION_STATES, "running"), "to_torn")
    assert not hasattr(transitions_model(VERSION_TABLE, VERSION_STATES, "declared"), "to_undeclared")
    assert not hasattr(transitions_model(WEIGHTS_TABLE, WEIGHTS_STATES, DC), "to_resident")


@pytest.mark.parametrize("allow_unpaused", [False, True])
@pytest.mark.parametrize(
    ("part", "table", "states"),
    [
        ("generation", GENERATION_TABLE, GENERATION_STATES),
        ("version", VERSION_TABLE, VERSION_STATES),
        ("weights", WEIGHTS_TABLE, WEIGHTS_STATES),
        ("kv_cache", KV_TABLE, KV_STATES),
    ],
)
def test_the_lookup_agrees_with_the_transitions_machine_built_from_the_same_rows(
    part: str, table: tuple[Row, ...], states: tuple[str, ...], allow_unpaused: bool
) -> None:
    for state in states:
        for trigger in dict.fromkeys(r.trigger for r in table):
            model = transitions_model(table, states, state)
            fired = try_fire(model, trigger, allow_unpaused=allow_unpaused)
            try:
                dest = move(trigger, state, part, allow_unpaused=allow_unpaused)
            except IllegalState:
                assert not fired and model.state == state, (trigger, state)
            else:
                assert fired and model.state == dest, (trigger, state)


def test_a_row_naming_an_unknown_condition_or_a_second_row_for_a_pair_is_refused() -> None:
    with pytest.raises(ValueError, match="no condition"):
        _index((Row("pause", "running", "paused", condition="when_asked"),))
    with pytest.raises(ValueError, match="two rows"):
        _index((Row("pause", "running", "paused"), Row("pause", "running", "torn")))


@given(
    generation=st.sampled_from(GENERATION_STATES),
    version=st.sampled_from(VERSION_STATES),
    weights=st.sampled_from(WEIGHTS_STATES),
    kv_cache=st.sampled_from(KV_STATES),
    trigger=st.sampled_from([*GENERATION_TRIGGERS, *VERSION_TRIGGERS, *MEMORY_TRIGGERS]),
    guard=st.sampled_from([None, "allow_unpaused", "wrote"]),
)
def test_totality_every_pair_moves_legally_or_raises_unchanged(
    generation: str, version: str, weights: str, kv_cache: str, trigger: str, guard: str | None
) -> None:
    before = {"generation": generation, "version": version, "weights": weights, "kv_cache": kv_cache}
    m = StateMachine(**before)
    expected = {
        "generation": GENERATION_MATRIX.get((trigger, guard), {}).get(generation, generation),
        "version": VERSION_MATRIX.get(trigger, {}).get(version, version),
        "weights": WEIGHTS_MATRIX.get(trigger, {}).get(weights, weights),
        "kv_cache": KV_MATRIX.get(trigger, {}).get(kv_cache, kv_cache),
    }
    legal = {"generation": GENERATION_STATES, "version": VERSION_STATES, "weights": WEIGHTS_STATES,
             "kv_cache": KV_STATES}  # fmt: skip
    excluded = trigger in VERSION_TRIGGERS and generation in (U, UT)
    try:
        m.fire(trigger, **({guard: True} if guard else {}))
    except IllegalState:
        assert m.states == before  # a refusal changes no part
        assert excluded or any(expected[p] not in legal[p] for p in PARTS)
    else:
        assert not excluded and m.states == expected  # every part moved as its matrix says
        if version == "declared":
            assert m.version == "declared"  # declared never reverts
