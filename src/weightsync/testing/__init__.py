"""Reusable test tools: a scriptable engine, a pure model, hypothesis strategies and the
conformance state machine that every engine and transport runs.  Needs ``hypothesis``."""

from __future__ import annotations

from .fake import ScriptableEngine
from .model import OMITTED, PureModel
from .stateful import ControllerHarness, Harness, PrefixCacheProbe, WeightSyncStateMachine, run_state_machine
from .strategies import bad_bodies, json_values, not_booleans, pause_bodies, update_flags

__all__ = [
    "OMITTED", "ControllerHarness", "Harness", "PrefixCacheProbe", "PureModel", "ScriptableEngine",
    "WeightSyncStateMachine", "bad_bodies", "json_values", "not_booleans", "pause_bodies",
    "run_state_machine", "update_flags",
]  # fmt: skip
