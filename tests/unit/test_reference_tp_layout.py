"""The reference engine's tensor-parallel split, in one process: the layout is exact, and
ranks that each hold only their slice compute what the whole model computes."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from tests.helpers import TINY
from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.layouts import WorkerLayout
from weightsync.core.snapshot import TensorSpec
from weightsync.engines.reference import CausalLM, ModelConfig
from weightsync.engines.reference.rank import RankModel
from weightsync.engines.reference.tp_layout import (
    FULL,
    check_tp_size,
    full_shapes,
    split_dim,
    take,
    tp_layout,
    worker_layout,
)


@pytest.mark.parametrize("config", [TINY, ModelConfig.tiny(tie_embeddings=True, qkv_bias=False)])
def test_full_shapes_are_the_models_without_building_it(config: ModelConfig) -> None:
    model = CausalLM(config, slots=1)
    assert full_shapes(config) == {n: tuple(t.shape) for n, t in model.weights().items()}


def test_the_ranks_slices_tile_every_split_tensor_and_the_rest_is_replicated() -> None:
    layout = tp_layout(TINY, 2)
    shapes = full_shapes(TINY)
    for name, shape in shapes.items():
        parts = [layout[r][name] for r in range(2)]
        if any(p == FULL for p in parts):
            assert all(p == FULL for p in parts), name
            assert "norm" in name or "embed" in name or "lm_head" in name, name
            continue
        dims = {p[0] for p in parts}  # type: ignore[index]
        assert len(dims) == 1, name
        covered = sorted((p[1], p[1] + p[2]) for p in parts)  # type: ignore[index]
        assert covered[0][0] == 0 and covered[-1][1] == shape[dims.pop()], name
        assert covered[0][1] == covered[1][0], name
    assert layout[1]["model.layers.0.self_attn.q_proj.weight"] == (0, 32, 32)
    assert layout[1]["model.layers.0.self_attn.o_proj.weight"] == (1, 32, 32)
    assert layout[0]["model.layers.0.mlp.down_proj.weight"] == (1, 0, 64)
    assert layout[0]["model.layers.0.self_attn.k_proj.bias"] == (0, 0, 16)


@pytest.mark.parametrize("size", [0, 3, 8])
def test_a_size_that_does_not_split_the_heads_is_refused(size: int) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_tp_size(TINY, size)  # 4 heads, 2 key/value heads
    assert err.value.code == "invalid_value"


def threaded_ranks(
    size: int,
) -> tuple[list[RankModel], Callable[[Callable[[RankModel], object]], list[object]]]:
    """``size`` ranks in threads, all-reducing through a barrier (no processes, no gloo)."""
    barrier = threading.Barrier(size)
    slots: list[torch.Tensor | None] = [None] * size
    local = threading.local()

    def reduce(x: torch.Tensor) -> torch.Tensor:
        slots[local.rank] = x.float()
        barrier.wait()
        total = sum(slots[1:], slots[0])  # type: ignore[arg-type]
        barrier.wait()
        return total.to(x.dtype)  # type: ignore[union-attr]

    ranks = [RankModel(TINY, slots=2, rank=r, size=size, reduce=reduce) for r in range(size)]

    def each(fn: Callable[[RankModel], object]) -> list[object]:
        out: list[object] = [None] * size

        def body(r: int) -> None:
            local.rank = r
            out[r] = fn(ranks[r])

        threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    return ranks, each


def test_ranks_holding_slices_compute_the_whole_models_logits() -> None:
    whole = RankModel(TINY, slots=2)
    ranks, each = threaded_ranks(2)
    assert tuple(ranks[1].weights()["model.layers.0.mlp.up_proj.weight"].shape) == (64, 64)
    tokens = torch.tensor([list(b"tensor parallel")])
    slot, start = torch.tensor([0]), torch.tensor([0])
    expected = whole.forward(tokens, slot, start)
    for got in each(lambda m: m.forward(tokens, slot, start)):
        assert isinstance(got, torch.Tensor)
        assert torch.allclose(got, expected, atol=1e-5) and int(got.argmax()) == int(expected.argmax())
    step = torch.tensor([[int(expected.argmax())]])
    expected = whole.forward(step, slot, torch.tensor([tokens.shape[1]]))
    for got in each(lambda m: m.forward(step, slot, torch.tensor([tokens.shape[1]]))):
        assert torch.allclose(got, expected, atol=1e-5)  # type: ignore[arg-type]


def test_load_full_keeps_the_ranks_slice_and_load_slice_checks_it() -> None:
    ranks, _ = threaded_ranks(2)
    name = "model.layers.1.self_attn.o_proj.weight"
    full = torch.randn(full_shapes(TINY)[name])
    ranks[1].load_full(name, full)
    assert torch.equal(ranks[1].weights()[name], take(full, (1, 32, 32)))
    before = ranks[0].weights()[name].clone()
    with pytest.raises(InvalidRequest) as err:
        ranks[0].load_slice(name, take(full, (1, 32, 32)).contiguous(), (1, 32, 32))  # rank 1's slice
    assert err.value.code == "shard_mismatch" and torch.equal(ranks[0].weights()[name], before)
    with pytest.raises(InvalidRequest):
        ranks[0].load_slice(name, full, FULL)
    ranks[0].load_slice(name, take(full, (1, 0, 32)).contiguous(), (1, 0, 32))
    assert torch.equal(ranks[0].weights()[name], take(full, (1, 0, 32)))


def test_the_layout_is_the_planners_tensor_parallel_worker_layout() -> None:
    specs = [TensorSpec(n, "float32", s) for n, s in full_shapes(TINY).items()]
    dims = {s.name: split_dim(s.name) for s in specs}
    expected = WorkerLayout.tensor_parallel("w", specs, 2, dims)
    assert worker_layout(TINY, 2, "w") == expected
    assert WorkerLayout.from_wire(expected.to_wire()) == worker_layout(TINY, 2, "w")
    assert worker_layout(TINY, 1, "w") == WorkerLayout.replica("w", specs)
