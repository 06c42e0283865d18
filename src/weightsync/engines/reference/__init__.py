"""The reference engine: a small torch transformer that makes weightsync run anywhere."""

from __future__ import annotations

from ..stamps import Completion, Span
from .engine import ReferenceEngine
from .model import CausalLM, ModelConfig

__all__ = ["CausalLM", "Completion", "ModelConfig", "ReferenceEngine", "Span"]
