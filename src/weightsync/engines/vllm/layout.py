"""A vLLM worker's tensor-parallel layout, read from vLLM's own parameter loaders.

vLLM 0.32 resolves, for its ``nccl_m2n`` backend, where each checkpoint parameter lands on a
worker (``vllm.distributed.weight_transfer.m2n_layout.resolve_parameter_destinations``): a
parameter whose loader is a known plain copy or tensor-parallel loader is *direct*, sharded
on the dim the loader declares (``output_dim`` for column-parallel, ``input_dim`` for
row-parallel) or replicated; anything else — fused parameters (``qkv_proj``,
``gate_up_proj``, MoE ``w13``/``w2``), quantized or pipeline-parallel models — *falls back*
to the full tensor on every rank, sharded afterwards by vLLM's ``load_weights``.

:func:`m2n_worker_layout` turns that resolution into a transfer plan's
:class:`~weightsync.core.plan.layouts.WorkerLayout` (split by
:meth:`~weightsync.core.plan.layouts.WorkerLayout.tensor_parallel`, as any TP worker): a
direct sharded parameter is rank ``r``'s ``r``-th equal piece along its dim; a replicated or
fallback one is the whole tensor (so a plan sends fallback tensors whole to every rank, and
says which they are).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync.core.plan.layouts import WorkerLayout
from weightsync.core.snapshot import TensorSpec


def m2n_worker_layout(
    model: Any,
    specs: Sequence[TensorSpec],
    *,
    tp_size: int,
    worker: str,
    allow_direct: bool = True,
) -> tuple[WorkerLayout, list[str]]:
    """The layout of a ``tp_size``-rank vLLM worker serving ``specs`` (full checkpoint names,
    dtypes and shapes), from one rank's ``model`` (its parameters and their loaders), and the
    names that fall back to full tensors.  Raises ``InvalidRequest`` (``invalid_layout``) when
    a sharded size does not split into ``tp_size`` pieces."""
    import torch
    from vllm.distributed.weight_transfer.m2n_common import DESTINATION_SHARD_AXIS, REPLICATE
    from vllm.distributed.weight_transfer.m2n_layout import resolve_parameter_destinations

    destinations = resolve_parameter_destinations(
        model,
        [s.name for s in specs],
        [getattr(torch, s.dtype) for s in specs],
        [list(s.shape) for s in specs],
        num_workers=tp_size,
        shard_axis_size=tp_size,
        allow_direct=allow_direct,
    )
    dims: dict[str, int | None] = {}
    fallback: list[str] = []
    for spec, dest in zip(specs, destinations, strict=True):
        if not dest.direct:
            fallback.append(spec.name)
        placements = dest.placements
        dim = None if not dest.direct or placements is None else placements[DESTINATION_SHARD_AXIS]
        dims[spec.name] = None if dim is None or dim == REPLICATE else int(dim)
    return WorkerLayout.tensor_parallel(worker, specs, tp_size, dims), fallback
