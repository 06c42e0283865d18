"""weightsync.core: the weight-state machine and its async controller, in pure Python.

Imports nothing heavy (no torch, no vllm, no web framework), so any server can embed it.
"""

from __future__ import annotations

from weightsync.core.controller import Controller
from weightsync.core.engine import Engine
from weightsync.core.errors import (
    EngineFailure,
    EngineUnavailable,
    IllegalState,
    InvalidRequest,
    LoadFailed,
    NotFound,
    NotSupported,
    PayloadTooLarge,
    Unauthorized,
    WeightsTorn,
    WeightSyncError,
)
from weightsync.core.requests import (
    AbortRequest,
    DestroyGroupRequest,
    EngineRpcRequest,
    InitGroupRequest,
    PauseRequest,
    SetWeightVersion,
    UpdateRequest,
)
from weightsync.core.routes import ROUTES, dispatch, parse
from weightsync.core.snapshot import (
    UNDECLARED,
    Declared,
    Generation,
    JournalEntry,
    LoadStats,
    PauseMode,
    PauseOutcome,
    PauseResult,
    Snapshot,
    TensorSpec,
    UpdateOutcome,
    Version,
    WeightInfo,
)
from weightsync.core.sources import DiskSource, DistributedSource, TensorHandle, TensorSource, WeightSource

__all__ = [
    "ROUTES", "UNDECLARED", "AbortRequest", "Controller", "Declared", "DestroyGroupRequest",
    "DiskSource", "DistributedSource", "Engine", "EngineFailure", "EngineRpcRequest",
    "EngineUnavailable", "Generation", "IllegalState", "InitGroupRequest", "InvalidRequest",
    "JournalEntry", "LoadFailed", "LoadStats", "NotFound", "NotSupported", "PauseMode",
    "PauseOutcome", "PauseRequest", "PauseResult", "PayloadTooLarge", "SetWeightVersion",
    "Snapshot", "TensorHandle", "TensorSource", "TensorSpec", "Unauthorized", "UpdateOutcome",
    "UpdateRequest", "Version", "WeightInfo", "WeightSource", "WeightSyncError", "WeightsTorn",
    "dispatch", "parse",
]  # fmt: skip
