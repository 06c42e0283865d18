"""The vLLM engine adapter and worker extension.  Importing this package does not import
vLLM; ``VllmEngine.from_engine_args`` does."""

from __future__ import annotations

from weightsync.engines.vllm.engine import EXTENSION, VllmEngine

__all__ = ["EXTENSION", "VllmEngine"]
