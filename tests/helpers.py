"""Shared helpers for the test tiers."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

from weightsync.engines.reference import ModelConfig
from weightsync.transports.sink import tensor_hashes

T = TypeVar("T")

TINY = ModelConfig(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, max_position=256
)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def hashes(engine: Any) -> dict[str, str]:
    return tensor_hashes(engine.model.weights().items())


def perturbed(
    weights: dict[str, torch.Tensor], seed: int = 1, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """New weights of the same names and shapes (what a trainer step produces)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.02
        out[name] = (t.float() + noise).to(dtype or t.dtype).contiguous()
    return out
