"""The reference engine: a small torch transformer that makes weightsync run anywhere."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from weightsync.engines.reference.engine import ReferenceEngine
from weightsync.engines.reference.model import CausalLM, ModelConfig
from weightsync.engines.stamps import Completion, Span

__all__ = ["CausalLM", "Completion", "ModelConfig", "ReferenceEngine", "Span", "build_engine"]


def build_engine(
    config: ModelConfig,
    *,
    tensor_parallel_size: int = 1,
    allowed_weight_dirs: Sequence[str | Path] | None = None,
    slots: int = 8,
    timeout_s: float = 60.0,
) -> ReferenceEngine:
    """A reference engine for ``config``, tensor-parallel over ``tensor_parallel_size``
    processes when above 1 (:mod:`.tp_runner`; blocks until every rank is up).  Raises
    ``InvalidRequest`` for a size that does not split ``config``, ``EngineFailure`` when a
    rank does not start within ``timeout_s``."""
    if tensor_parallel_size == 1:
        return ReferenceEngine(config, slots=slots, allowed_weight_dirs=allowed_weight_dirs)
    from weightsync.engines.reference.tp_runner import TPRunner

    runner = TPRunner.start(config, tensor_parallel_size, slots=slots, timeout_s=timeout_s)
    return ReferenceEngine(config, slots=slots, allowed_weight_dirs=allowed_weight_dirs, runner=runner)
