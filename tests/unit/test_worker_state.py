"""The pure steps beside the tables (WorkerState) and the held-weights value they carry."""

from __future__ import annotations

import pytest

from weightsync.core._state import REFUSED, SUCCEEDED, TORE, UpdateSteps
from weightsync.core.errors import EngineFailure, IllegalState, InvalidRequest, LoadFailed, WeightsTorn
from weightsync.core.held import HeldWeights, weights_digest
from weightsync.core.snapshot import UNDECLARED, Declared, Generation
from weightsync.core.worker_state import WorkerState, load_failure

START = {"a": "01", "b": "02"}


def test_held_weights_merge_a_complete_load_and_forget_everything_on_an_unhashed_one() -> None:
    held = HeldWeights.starting_with(START)
    assert held.digest == weights_digest(START)
    loaded = held.loaded({"a": "0a"}, written=1)
    assert loaded.digest == weights_digest({"a": "0a", "b": "02"}) and held.digest == weights_digest(START)
    unhashed = held.loaded({"a": "0a"}, written=2)
    assert unhashed.digest is None and unhashed.unknown == {"a", "b"}
    assert held.loaded(None, written=0) is held  # nothing written: nothing changed


def test_held_weights_after_a_tear_know_nothing_until_every_tensor_is_loaded_again() -> None:
    torn = HeldWeights.starting_with(START).torn()
    assert torn.digest is None
    assert torn.loaded({"a": "0a"}, written=1).digest is None
    assert torn.loaded({"a": "0a", "b": "0b"}, written=2).digest == weights_digest({"a": "0a", "b": "0b"})


def test_a_worker_that_started_unknown_never_reports_a_digest() -> None:
    held = HeldWeights.starting_with(None)
    assert held.digest is None and held.loaded({"a": "0a"}, written=1).digest is None
    assert held.digest_after({"a": "0a"}) is None


def test_the_dry_run_prediction_is_the_digest_after_the_load_and_none_for_new_names() -> None:
    held = HeldWeights.starting_with(START)
    assert held.digest_after({"b": "0b"}) == held.loaded({"b": "0b"}, written=1).digest
    assert held.digest_after({"c": "03"}) is None
    assert held.digest_after(None) is None
    assert held.torn().digest_after({"a": "0a"}) is None
    assert held.torn().digest_after({"a": "0a", "b": "0b"}) == weights_digest({"a": "0a", "b": "0b"})


def test_an_update_while_running_is_refused_and_the_state_is_unchanged() -> None:
    state = WorkerState.starting(version=UNDECLARED, paused=False, hashes=START)
    with pytest.raises(IllegalState) as err:
        state.update_begun(UpdateSteps())
    assert err.value.code == "not_paused" and not state.update_in_flight
    assert state.update_begun(UpdateSteps(), allow_unpaused=True).update_in_flight


def test_a_versioned_success_declares_after_the_weights_are_in_and_counts_one_commit() -> None:
    state = WorkerState.starting(version=UNDECLARED, paused=True, hashes=START)
    steps = UpdateSteps(declares=True)
    during = state.update_begun(steps)
    after = during.update_ended(steps, SUCCEEDED, version=Declared("v1"), hashes={"a": "0a"}, written=1)
    assert (after.version, after.generation, after.commits, after.update_in_flight) == (
        Declared("v1"), Generation.PAUSED, 1, False,
    )  # fmt: skip
    assert after.held.digest == weights_digest({"a": "0a", "b": "02"})


def test_a_tear_pauses_keeps_the_label_and_forgets_the_digest_and_a_refusal_changes_nothing() -> None:
    state = WorkerState.starting(version=Declared("v0"), paused=False, hashes=START)
    steps = UpdateSteps(declares=True)
    during = state.update_begun(steps, allow_unpaused=True)
    torn = during.update_ended(steps, TORE)
    assert (torn.generation, torn.version, torn.held.digest, torn.commits) == (
        Generation.TORN,
        Declared("v0"),
        None,
        1,
    )
    with pytest.raises(IllegalState) as err:
        torn.resumed()
    assert err.value.code == "weights_torn"
    refused = during.update_ended(steps, REFUSED)
    assert refused == state


def test_a_declaration_guard_refuses_and_an_epoch_never_goes_backwards() -> None:
    state = WorkerState.starting(version=UNDECLARED, paused=False, hashes=START).declared(
        Declared(1), epoch=5
    )
    with pytest.raises(IllegalState, match="older"):
        state.declared(Declared(2), epoch=4)
    with pytest.raises(IllegalState) as err:
        state.declared(Declared(2), expected_digest="ff")
    assert err.value.code == "digest_mismatch"
    assert state.declared(Declared(2)).epoch == 5


@pytest.mark.parametrize(
    ("exc", "ending", "raised"),
    [
        (LoadFailed("x", wrote=True), TORE, WeightsTorn),
        (
            LoadFailed("x", wrote=False, cause=InvalidRequest("bad", code="bad_shape")),
            REFUSED,
            InvalidRequest,
        ),
        (LoadFailed("x", wrote=False), REFUSED, LoadFailed),
        (EngineFailure("x"), REFUSED, EngineFailure),
        (KeyError("x"), TORE, WeightsTorn),
    ],
)
def test_only_a_write_or_a_broken_contract_tears(exc: BaseException, ending: str, raised: type) -> None:
    got_ending, error = load_failure(exc)
    assert got_ending == ending and type(error) is raised
