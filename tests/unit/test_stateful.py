"""The shipped conformance state machine, run in process against the controller, and shown
to fail, with a message, on engines that lie."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.core import _state
from weightsync.core.errors import LoadFailed
from weightsync.core.snapshot import LoadStats
from weightsync.core.sources import WeightSource
from weightsync.testing import OMITTED, ControllerHarness, PureModel, ScriptableEngine, run_state_machine


def test_controller_conforms_to_the_pure_model() -> None:
    run_state_machine(ControllerHarness, max_examples=500, stateful_step_count=25)


def test_the_scriptable_engine_lets_the_machine_observe_its_prefix_cache() -> None:
    harness = ControllerHarness()
    try:
        assert harness.observes_prefix_cache
        harness.warm_cache("alpha")
        assert harness.prefix_cached("alpha") and not harness.prefix_cached("beta")
    finally:
        harness.close()


def test_state_machine_catches_a_broken_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # Let a torn worker resume: the conformance machine must notice.
    broken = (*_state.GENERATION_TABLE, _state.Row("resume", "torn", "running"))
    monkeypatch.setattr(_state, "GENERATION_TABLE", broken)
    with pytest.raises(AssertionError, match="rule broken: resume_generation must be refused"):
        run_state_machine(ControllerHarness, max_examples=300, stateful_step_count=25, shrink=False)


class LyingCacheEngine(ScriptableEngine):
    """Says it reset the prefix cache, and kept it."""

    async def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))


class HollowLoadEngine(ScriptableEngine):
    """Reports a successful load and writes nothing."""

    async def load_weights(self, source: WeightSource) -> LoadStats:
        if getattr(source, "model_path", "").startswith("ok:"):
            self.calls.append(("load_weights", source))
            return LoadStats(tensors=4, bytes=64, seconds=0.0)
        return await super().load_weights(source)


def failure_of(engine_class: type[ScriptableEngine]) -> str:
    with pytest.raises(AssertionError) as err:
        run_state_machine(
            lambda: ControllerHarness(engine_class()), max_examples=300, stateful_step_count=25, shrink=False
        )
    return str(err.value)


def test_kit_fails_on_an_engine_whose_cache_reset_lies() -> None:
    message = failure_of(LyingCacheEngine)
    assert "rule broken: " in message and "no prompt is served from the prefix cache" in message
    assert "commands sent:" in message and "(generate " in message
    assert "model expects: prefix cache empty" in message and "prompts still cached: [" in message


def test_kit_fails_on_an_engine_that_reports_a_load_but_writes_nothing() -> None:
    message = failure_of(HollowLoadEngine)
    assert (
        "rule broken: an update that succeeds serves the new weights" in message
        or "rule broken: a finished session serves the weights it streamed" in message
    ), message
    assert "update_weights_from_disk" in message and "commands sent:" in message
    assert "model expects: PureModel(" in message and "worker has:    fingerprint" in message


def test_sentinels_and_a_declared_null_have_readable_reprs() -> None:
    assert repr(OMITTED) == "OMITTED"
    model = PureModel()
    assert "version=undeclared" in repr(model)
    model.declare(None)
    assert "version=declared(None)" in repr(model)


def test_failure_message_names_rule_commands_and_both_states() -> None:
    from weightsync.testing.stateful import WeightSyncStateMachine

    machine: Any = WeightSyncStateMachine()
    machine._send("pause_generation", {"mode": "keep"})
    text = machine._explain("some rule", worker={"paused": False})
    machine.teardown()
    assert text.splitlines()[0] == "rule broken: some rule"
    assert '1. pause_generation {"mode": "keep"} -> ok' in text
    assert (
        "model expects: PureModel(version=undeclared" in text and "worker has:    {'paused': False}" in text
    )


class StagingEngine(ScriptableEngine):
    """Loads an update on a running worker into a copy, as the reference engine does: a
    failure there discards the copy (a 500, nothing served changed) instead of tearing."""

    async def load_weights(self, source: WeightSource) -> LoadStats:
        if self.running and getattr(source, "model_path", "") == "tear":
            self.calls.append(("load_weights", source))
            raise LoadFailed("scripted read failure into the staging copy", wrote=False, code="read_failed")
        return await super().load_weights(source)


class StagingHarness(ControllerHarness):
    unpaused_tear_code = "read_failed"

    def __init__(self) -> None:
        super().__init__(StagingEngine())


def test_kit_expects_a_staged_tear_on_a_running_worker_to_change_nothing() -> None:
    run_state_machine(StagingHarness, max_examples=150, stateful_step_count=20)
    # Without unpaused_tear_code the same engine fails the kit: the model expected a tear.
    message = failure_of(StagingEngine)
    assert "must be refused with code 'weights_torn'" in message and "read_failed" in message
