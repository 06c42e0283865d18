"""The routing table, checked twice (a hand-written matrix and a hypothesis totality test),
and :func:`observe`, the pure decision of what one poll saw."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.router._state import (
    FENCED,
    STATES,
    TRIGGERS,
    Label,
    RoutingMachine,
    observe,
)

_WATCHED = ("unknown", "routable", "paused", "fenced", "unreachable")
_OWNED = ("draining", "updating")

# trigger -> {source: destination}; every pair not listed changes nothing.
# Written by hand from docs/router.md, not derived from the table.
MATRIX: dict[str, dict[str, str]] = {
    "seen_committed": {
        "unknown": "routable", "routable": "routable", "paused": "routable", "fenced": "routable",
        "unreachable": "routable", "draining": "draining", "updating": "updating",
    },
    "seen_paused": {
        "unknown": "fenced", "routable": "fenced", "paused": "paused", "fenced": "fenced",
        "unreachable": "fenced", "draining": "draining", "updating": "updating",
    },
    "seen_uncommitted": {
        "unknown": "fenced", "routable": "fenced", "paused": "fenced", "fenced": "fenced",
        "unreachable": "fenced", "draining": "draining", "updating": "updating",
    },
    "lost": {
        "unknown": "unreachable", "routable": "unreachable", "paused": "unreachable",
        "fenced": "unreachable", "unreachable": "unreachable", "draining": "draining",
        "updating": "updating",
    },
    "drain": {s: "draining" for s in _WATCHED},
    "update": {"draining": "updating"},
    "release": {"draining": "unknown", "updating": "unknown"},
    "pause": {"unknown": "paused", "routable": "paused", "paused": "paused"},
    "resume": {"paused": "unknown"},
}  # fmt: skip


def test_matrix_names_every_trigger_of_the_table() -> None:
    assert set(MATRIX) == set(TRIGGERS)


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("trigger", sorted(MATRIX))
def test_matrix(state: str, trigger: str) -> None:
    m = RoutingMachine(state)
    expected = MATRIX[trigger].get(state)
    assert m.fire(trigger) is (expected is not None)
    assert m.state == (expected or state)


@given(st.sampled_from(STATES), st.lists(st.sampled_from(TRIGGERS), max_size=30))
def test_any_sequence_lands_in_a_state_and_refusals_change_nothing(start: str, triggers: list[str]) -> None:
    m = RoutingMachine(start)
    for trigger in triggers:
        before = m.state
        moved = m.fire(trigger)
        assert m.state in STATES
        if not moved:
            assert m.state == before
        else:
            assert m.state == MATRIX[trigger][before]
        # Only the poller's observation of a committed, running worker makes it routable.
        if m.state == "routable" and before != "routable":
            assert trigger == "seen_committed"
        assert m.routable == (m.state == "routable")
        assert m.fenced == (m.state in FENCED)


def test_a_transaction_owns_its_workers_until_it_releases_them() -> None:
    for observation in ("seen_committed", "seen_paused", "seen_uncommitted", "lost"):
        for owned in _OWNED:
            m = RoutingMachine(owned)
            m.fire(observation)
            assert m.state == owned


def test_unknown_trigger_and_state_are_programming_errors() -> None:
    with pytest.raises(ValueError, match="unknown trigger"):
        RoutingMachine().fire("explode")
    with pytest.raises(ValueError, match="unknown routing state"):
        RoutingMachine("asleep")


COMMITTED = Label(True, "v1", 3, "abc")


def reply(**changes: Any) -> dict[str, Any]:
    base = {
        "status": "ok", "version": "v1", "version_declared": True, "epoch": 3, "digest": "abc",
        "paused": False, "torn": False, "update_in_flight": False,
    }  # fmt: skip
    return {**base, **changes}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, "seen_committed"),
        ({"paused": True}, "seen_paused"),
        ({"torn": True, "paused": True}, "seen_uncommitted"),
        ({"update_in_flight": True}, "seen_uncommitted"),
        ({"digest": "abd"}, "seen_uncommitted"),
        ({"digest": None}, "seen_uncommitted"),
        ({"epoch": 4}, "seen_uncommitted"),
        ({"epoch": None}, "seen_uncommitted"),
        ({"version": "v2"}, "seen_uncommitted"),
        ({"version_declared": False}, "seen_uncommitted"),
        ({"digest": "abd", "paused": True}, "seen_uncommitted"),
        ({"torn": None}, "seen_uncommitted"),  # a reply that does not say is not trusted
    ],
)
def test_observe(changes: dict[str, Any], expected: str) -> None:
    assert observe(reply(**changes), COMMITTED) == expected


def test_observe_without_an_answer_or_a_committed_label() -> None:
    assert observe(None, COMMITTED) == "lost"
    assert observe(reply(), None) == "seen_uncommitted"


def test_labels_compare_versions_as_json_values() -> None:
    assert Label(True, 1, 1, "a").same(Label(True, 1, 1, "a"))
    assert not Label(True, 1, 1, "a").same(Label(True, True, 1, "a"))
    assert not Label(True, 1, 1, "a").same(Label(True, 1.0, 1, "a"))
    assert Label(True, {"a": 1, "b": 2}, 1, "a").same(Label(True, {"b": 2, "a": 1}, 1, "a"))
    assert not Label(True, None, None, None).same(Label(True, None, None, None))  # no digest, no proof
