"""Which slice of each weight a tensor-parallel rank of the reference engine serves.

Megatron's split, on Hugging Face names (``W`` is ``[out_features, in_features]``):

* column-parallel, split on dim 0 (the output features): ``q_proj``, ``k_proj``, ``v_proj``
  (weights and biases; whole heads, so rank ``r`` has query heads ``r*H/T ..`` and the key/value
  heads they read), ``gate_proj``, ``up_proj``;
* row-parallel, split on dim 1 (the input features): ``o_proj``, ``down_proj``; each rank's
  partial output is summed over the ranks (one all-reduce after attention, one after the MLP);
* replicated, every rank has the whole tensor: embeddings, ``lm_head``, every norm.

Rank ``r`` of ``T`` serves the ``r``-th of ``T`` equal, contiguous pieces along the split dim.
This module is pure (shapes and names only); :func:`tp_layout` is what a transfer plan reads.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch

from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.layouts import WorkerLayout
from weightsync.core.snapshot import TensorSpec
from weightsync.engines.reference.model import ModelConfig

FULL: Literal["full"] = "full"

# A rank's part of one tensor: "full", or (dim, start, length) along that dim.
Part: TypeAlias = "tuple[int, int, int] | Literal['full']"

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def check_tp_size(config: ModelConfig, size: int) -> None:
    """Raises ``InvalidRequest`` (``invalid_value``) unless ``size`` ranks can split ``config``:
    query heads, key/value heads and MLP features must each divide evenly."""
    if not 1 <= size <= 64:
        raise InvalidRequest(
            f"tensor parallel size must be in [1, 64], got {size}",
            code="invalid_value",
            field="tensor_parallel_size",
        )
    for what, n in (
        ("num_heads", config.num_heads),
        ("num_kv_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if n % size:
            raise InvalidRequest(
                f"tensor parallel size {size} does not divide {what} ({n})",
                code="invalid_value",
                field="tensor_parallel_size",
            )


def split_dim(name: str) -> int | None:
    """The dim ``name`` is split on across ranks, or ``None`` when every rank has it whole."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _COLUMN:
        return 0
    if len(parts) >= 2 and parts[-2] in _ROW and parts[-1] == "weight":
        return 1
    return None


def part_of(name: str, shape: tuple[int, ...], rank: int, size: int) -> Part:
    """What rank ``rank`` of ``size`` serves of the tensor ``name`` of full ``shape``."""
    dim = split_dim(name)
    if dim is None or size == 1:
        return FULL
    length = shape[dim] // size
    return (dim, rank * length, length)


def part_box(shape: tuple[int, ...], part: Part) -> Box:
    """``part`` of a tensor of full ``shape`` as a :class:`~weightsync.core.plan.boxes.Box`."""
    return Box.full(shape) if part == FULL else Box.along(shape, part[0], part[1], part[1] + part[2])


def tp_layout(config: ModelConfig, size: int) -> list[dict[str, Part]]:
    """Per rank (index = rank), every weight name -> the part of it that rank serves:
    ``"full"`` or ``(dim, start, length)``.  Raises ``InvalidRequest`` for a size that does
    not split ``config`` (see :func:`check_tp_size`)."""
    check_tp_size(config, size)
    shapes = full_shapes(config)
    return [{name: part_of(name, shape, r, size) for name, shape in shapes.items()} for r in range(size)]


def worker_layout(config: ModelConfig, size: int, worker: str) -> WorkerLayout:
    """:func:`tp_layout` as the planner's :class:`~weightsync.core.plan.layouts.WorkerLayout` for
    the worker named ``worker`` (a box per rank and tensor, in full-tensor coordinates)."""
    shapes = full_shapes(config)
    specs = tuple(TensorSpec(n, config.dtype, s) for n, s in shapes.items())
    serves = tuple(
        tuple(part_box(shapes[n], p) for n, p in parts.items()) for parts in tp_layout(config, size)
    )
    return WorkerLayout(worker, specs, serves)


def full_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name -> its full shape, in :meth:`CausalLM.weights` order, without
    building the model."""
    c = config
    kv = c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        for proj, out in (("q_proj", c.hidden_size), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{proj}.weight"] = (out, c.hidden_size)
            if c.qkv_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.hidden_size)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def take(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """The view of a full ``tensor`` that ``part`` names."""
    if part == FULL:
        return tensor
    dim, start, length = part
    return tensor.narrow(dim, start, length)
