"""A vLLM worker's TP layout from vLLM's own resolution (``m2n_layout``, the installed vllm
package's code, no engine): parameters with vLLM's column-/row-parallel loaders become TP
shards on the loader's declared dim, plain-copy ones whole, a fused one falls back whole."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

with warnings.catch_warnings():  # vLLM's imports warn about torch APIs it uses
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm.distributed.weight_transfer.m2n_layout")
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from weightsync.core.snapshot import TensorSpec
from weightsync.engines.vllm.layout import m2n_worker_layout

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # importing vLLM takes tens of seconds

TP = 2


def _param(shape: tuple[int, ...], loader: object, **attrs: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def rank_model() -> torch.nn.Module:
    """One TP rank's parameters, carrying the loaders vLLM's layers give them."""
    owner = types.SimpleNamespace(tp_size=TP)
    m = torch.nn.Module()
    m.up = torch.nn.Module()
    m.up.register_parameter(
        "weight", _param((8, 16), types.MethodType(ColumnParallelLinear.weight_loader, owner), output_dim=0)
    )
    m.down = torch.nn.Module()
    m.down.register_parameter(
        "weight", _param((16, 4), types.MethodType(RowParallelLinear.weight_loader, owner), input_dim=1)
    )
    m.norm = torch.nn.Module()
    m.norm.register_parameter("weight", _param((16,), default_weight_loader))
    return m


SPECS = [
    TensorSpec("up.weight", "float32", (16, 16)),
    TensorSpec("down.weight", "float32", (16, 8)),
    TensorSpec("norm.weight", "float32", (16,)),
    TensorSpec("qkv_proj.weight", "float32", (24, 16)),  # names no vLLM parameter: fused
]


def test_vllm_loaders_decide_each_ranks_box_and_fused_tensors_fall_back_whole() -> None:
    layout, fallback = m2n_worker_layout(rank_model(), SPECS, tp_size=TP, worker="vllm")
    assert layout.world_size == TP
    assert fallback == ["qkv_proj.weight"]
    for r in range(TP):
        served = layout.served(r)
        assert served["up.weight"].bounds == ((8 * r, 8 * r + 8), (0, 16))  # column-parallel: dim 0
        assert served["down.weight"].bounds == ((0, 16), (4 * r, 4 * r + 4))  # row-parallel: dim 1
        assert served["norm.weight"].bounds == ((0, 16),)  # replicated
        assert served["qkv_proj.weight"].bounds == ((0, 24), (0, 16))  # fallback: whole


def test_without_direct_loading_every_tensor_falls_back_whole() -> None:
    layout, fallback = m2n_worker_layout(rank_model(), SPECS, tp_size=TP, worker="vllm", allow_direct=False)
    assert fallback == [s.name for s in SPECS]
    assert all(
        b.bounds == tuple((0, n) for n in s.shape) for s, b in zip(SPECS, layout.serves[1], strict=True)
    )
