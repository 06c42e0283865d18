"""The shipped conformance state machine, run in process against the controller."""

from __future__ import annotations

import pytest

from weightsync.core import _state
from weightsync.testing import ControllerHarness, run_state_machine


def test_controller_conforms_to_the_pure_model() -> None:
    run_state_machine(ControllerHarness, max_examples=500, stateful_step_count=25)


def test_state_machine_catches_a_broken_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # Let a torn worker resume: the conformance machine must notice.
    broken = (*_state.GENERATION_TABLE, _state.Row("resume", "torn", "running"))
    monkeypatch.setattr(_state, "GENERATION_TABLE", broken)
    with pytest.raises(AssertionError):
        run_state_machine(ControllerHarness, max_examples=300, stateful_step_count=25)
