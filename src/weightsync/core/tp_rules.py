"""Megatron's tensor-parallel rule by Hugging Face tensor names: which dim of each tensor a
TP split cuts (or none).  Pure Python."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from weightsync.core.values import TensorSpec

COLUMN_PARALLEL: Final = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
ROW_PARALLEL: Final = ("o_proj", "down_proj")


def tp_dims(specs: Sequence[TensorSpec], *, shard_embeddings: bool) -> dict[str, int | None]:
    """Megatron's TP rule by Hugging Face names: column-parallel projections (and their
    biases) on dim 0, row-parallel weights on dim 1 (their biases whole), norms whole;
    ``embed_tokens``/``lm_head`` on dim 0 (vocab-parallel) when ``shard_embeddings``, whole
    otherwise."""
    out: dict[str, int | None] = {}
    for s in specs:
        parts = s.name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module in COLUMN_PARALLEL:
            out[s.name] = 0
        elif module in ROW_PARALLEL and parts[-1] == "weight" and len(s.shape) == 2:
            out[s.name] = 1
        elif module in ("embed_tokens", "lm_head") and shard_embeddings:
            out[s.name] = 0
        else:
            out[s.name] = None
    return out
