"""Reusable test tools: a scriptable engine, a pure model, hypothesis strategies and the
conformance state machine that every engine and transport runs.  Needs ``hypothesis``."""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401
except ImportError as exc:  # the kit is built on hypothesis, which only the dev extra installs
    raise ImportError(
        "weightsync.testing needs hypothesis, from the dev extra: pip install 'weightsync[dev]' "
        "(from a clone: pip install '.[http,torch,dev]')",
        name=exc.name,
    ) from None

from weightsync.testing.fake import ScriptableEngine
from weightsync.testing.model import OMITTED, PureModel
from weightsync.testing.stateful import (
    ControllerHarness,
    Harness,
    PrefixCacheProbe,
    WeightSyncStateMachine,
    run_state_machine,
)
from weightsync.testing.strategies import bad_bodies, json_values, not_booleans, pause_bodies, update_flags

__all__ = [
    "OMITTED", "ControllerHarness", "Harness", "PrefixCacheProbe", "PureModel", "ScriptableEngine",
    "WeightSyncStateMachine", "bad_bodies", "json_values", "not_booleans", "pause_bodies",
    "run_state_machine", "update_flags",
]  # fmt: skip
