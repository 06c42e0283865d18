"""make_plan's output pinned: for a set of varied layout pairs, the plan (every transfer's
round, source, destination, buffer and size, every piece's tensor, box, offset and bytes, in
order) hashes to what the planner produced before its speed-ups.  Any change to which
pieces are cut, which rank sends them, how they are packed or in which order they run fails
here by name."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import pytest

from weightsync.core.plan.boxes import Box, chunk_bounds
from weightsync.core.plan.build import make_plan
from weightsync.core.plan.layouts import (
    FleetLayout,
    Holding,
    TensorLayout,
    TrainerLayout,
    WorkerLayout,
    tp_dims,
)
from weightsync.core.plan.value import Plan
from weightsync.core.snapshot import TensorSpec

pytestmark = pytest.mark.unit

# a small model: column/row-parallel projections, norms, embeddings, a bias, a 3-d tensor,
# sizes that torch.chunk cuts unevenly across many ranks (37 rows on 8 or 64 ranks)
MODEL = (
    TensorSpec("model.embed_tokens.weight", "bfloat16", (96, 16)),
    TensorSpec("model.layers.0.self_attn.q_proj.weight", "bfloat16", (48, 16)),
    TensorSpec("model.layers.0.self_attn.q_proj.bias", "float32", (48,)),
    TensorSpec("model.layers.0.self_attn.k_proj.weight", "bfloat16", (8, 16)),
    TensorSpec("model.layers.0.self_attn.o_proj.weight", "bfloat16", (16, 48)),
    TensorSpec("model.layers.0.mlp.gate_up_proj.weight", "float16", (64, 16)),
    TensorSpec("model.layers.0.mlp.down_proj.weight", "float32", (16, 32)),
    TensorSpec("model.layers.0.input_layernorm.weight", "float32", (37,)),
    TensorSpec("model.layers.0.odd.weight", "int8", (37, 5)),
    TensorSpec("model.layers.0.cube.weight", "float64", (6, 10, 4)),
    TensorSpec("model.norm.weight", "bfloat16", (16,)),
    TensorSpec("lm_head.weight", "bfloat16", (96, 16)),
)


NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm")
LAYERS = tuple(
    TensorSpec(
        f"model.layers.{i // 8}.x.{NAMES[i % 8]}.weight", "bfloat16", (512,) if i % 8 == 7 else (512, 512)
    )
    for i in range(24)
)  # the shapes of the planner's scale check, three layers of them


def tp_worker(name: str, tp: int, *, shard_embeddings: bool = False) -> WorkerLayout:
    return WorkerLayout.tensor_parallel(name, MODEL, tp, tp_dims(MODEL, shard_embeddings=shard_embeddings))


def hsdp(specs: tuple[TensorSpec, ...], shards: int, replicas: int) -> TrainerLayout:
    """Each tensor cut on dim 0 into ``shards``, shard ``i`` held by ranks ``i, i + shards, ...``."""
    out = []
    for s in specs:
        holdings = tuple(
            Holding(Box.along(s.shape, 0, a, b), tuple(i + k * shards for k in range(replicas)))
            for i, (a, b) in enumerate(chunk_bounds(s.shape[0], shards))
            if b > a
        )
        out.append(TensorLayout(s, holdings))
    return TrainerLayout(shards * replicas, tuple(out))


def grid_worker(name: str) -> WorkerLayout:
    """Four ranks, each serving one quarter of every 2-d tensor (cut on both dims), the rest whole."""
    serves = []
    for r in range(4):
        boxes = []
        for s in MODEL:
            if len(s.shape) == 2:
                (h, w), (i, j) = s.shape, divmod(r, 2)
                boxes.append(Box(((i * h // 2, (i + 1) * h // 2), (j * w // 2, (j + 1) * w // 2))))
            else:
                boxes.append(Box.full(s.shape))
        serves.append(tuple(boxes))
    return WorkerLayout(name, MODEL, tuple(serves))


CASES: dict[str, tuple[Callable[[], tuple[TrainerLayout, FleetLayout]], dict[str, int]]] = {
    "whole3_into_tp2_and_replica": (
        lambda: (
            TrainerLayout.whole(MODEL, 3),
            FleetLayout((tp_worker("a", 2), WorkerLayout.replica("b", MODEL))),
        ),
        {},
    ),
    "fsdp8_into_tp2_tp4": (
        lambda: (TrainerLayout.fsdp(MODEL, 8), FleetLayout((tp_worker("a", 2), tp_worker("b", 4)))),
        {},
    ),
    "fsdp64_into_tp8_small_buckets": (
        lambda: (TrainerLayout.fsdp(MODEL, 64), FleetLayout((tp_worker("a", 8),))),
        {"bucket_bytes": 256},
    ),
    "fsdp5_into_tp8_sharded_embeddings": (
        lambda: (TrainerLayout.fsdp(MODEL, 5), FleetLayout((tp_worker("a", 8, shard_embeddings=True),))),
        {"bucket_bytes": 1024},
    ),
    "tp4_into_tp2_and_tp8": (
        lambda: (
            TrainerLayout.tp(MODEL, 4),
            FleetLayout((tp_worker("a", 2, shard_embeddings=True), tp_worker("b", 8))),
        ),
        {"bucket_bytes": 512},
    ),
    "replicated3_into_tp2_split": (
        lambda: (TrainerLayout.replicated(MODEL, 3), FleetLayout((tp_worker("a", 2),))),
        {"bucket_bytes": 640, "split_bytes": 64},
    ),
    "replicated4_into_replicas_unsplit": (
        lambda: (
            TrainerLayout.replicated(MODEL, 4),
            FleetLayout(tuple(WorkerLayout.replica(f"w{i}", MODEL) for i in range(3))),
        ),
        {},
    ),
    "hsdp_4x2_into_tp4_split": (
        lambda: (hsdp(MODEL, 4, 2), FleetLayout((tp_worker("a", 4), tp_worker("b", 2)))),
        {"bucket_bytes": 300, "split_bytes": 32},
    ),
    "hsdp_16x3_into_tp8": (
        lambda: (hsdp(MODEL, 16, 3), FleetLayout((tp_worker("a", 8, shard_embeddings=True),))),
        {"bucket_bytes": 4096, "split_bytes": 16},
    ),
    "fsdp12_into_grid_and_tp2": (
        lambda: (TrainerLayout.fsdp(MODEL, 12), FleetLayout((grid_worker("g"), tp_worker("a", 2)))),
        {"bucket_bytes": 200},
    ),
    "layers_fsdp64_into_tp8": (
        lambda: (
            TrainerLayout.fsdp(LAYERS, 64),
            FleetLayout(
                (WorkerLayout.tensor_parallel("w0", LAYERS, 8, tp_dims(LAYERS, shard_embeddings=False)),)
            ),
        ),
        {"bucket_bytes": 1 << 16},
    ),
    "tp8_into_grid_direct": (
        lambda: (TrainerLayout.tp(MODEL, 8), FleetLayout((grid_worker("g"),))),
        {"bucket_bytes": 64},
    ),
}

PINNED = {
    "fsdp12_into_grid_and_tp2": "c1958158a7df22eb2c51dd34d6b5d663f9cbc8dcd0aaf4faaf1bf4dc623d4572",  # 311 transfers, 502 pieces
    "fsdp5_into_tp8_sharded_embeddings": "0f6d8ad9871a6a9d5cf08a7e6737cc938c7301f8a642439c5c7486ff65ac95bc",  # 53 transfers, 264 pieces
    "fsdp64_into_tp8_small_buckets": "b8045a65ec2e1053b0aa90e7ee07ca5bf3bb6d20fac719f2ffea954516c44053",  # 632 transfers, 1960 pieces
    "fsdp8_into_tp2_tp4": "815c7e315d07e0f6fac7326db6f86e692e9e79718c7b28badda783331e98103b",  # 48 transfers, 436 pieces
    "hsdp_16x3_into_tp8": "0eb7c2d7864339e2020d766727abfabb70a5dc6c45156880e0597dda145f7129",  # 368 transfers, 1224 pieces
    "hsdp_4x2_into_tp4_split": "13c681f8ef0b50109e5b2a11064a503302b56221cb9fe980c7d37931b0dab8fb",  # 239 transfers, 406 pieces
    "layers_fsdp64_into_tp8": "5b79a256353d09f3b37d0d60c18f95b1ca338473b7df17a809964035dd94647d",  # 640 transfers, 5568 pieces
    "replicated3_into_tp2_split": "074f043a36613eb433604cdd5cddf9b5eb6230eefbdef4e1452d7006fde24cbe",  # 38 transfers, 68 pieces
    "replicated4_into_replicas_unsplit": "11b7c5e30bb12a1be2f58145dbb8cbff6bc700c0ac8cc9795255cb7e0238a5cc",  # 12 transfers, 36 pieces
    "tp4_into_tp2_and_tp8": "63220dea75e323c8e1b64adb0baa4fd72798ee6b1e65b2021fe14005be583df1",  # 124 transfers, 184 pieces
    "tp8_into_grid_direct": "d36af59dab1e51898dc6d55995f8d69ceb070ed2aebefbc607cddf4266dcd1fe",  # 160 transfers, 160 pieces
    "whole3_into_tp2_and_replica": "a50a1f239dd065ff4155124559ec82ddce93ee3a87b72cc75b5d17c74a5f6e62",  # 9 transfers, 36 pieces
}


def canonical(plan: Plan) -> str:
    """Everything a plan decides, in its order, as JSON text."""
    transfers = [
        [t.index, t.round, t.src, t.worker, t.rank, t.dst, t.buffer, t.size]
        + [[p.name, p.box.to_wire(), p.offset, p.nbytes] for p in t.pieces]
        for t in plan.transfers
    ]
    whole = {"bucket_bytes": plan.bucket_bytes, "rounds": plan.rounds, "transfers": transfers}
    return json.dumps(whole, separators=(",", ":"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_is_the_pinned_one(case: str) -> None:
    build, kwargs = CASES[case]
    trainer, fleet = build()
    plan = make_plan(trainer, fleet, **kwargs)
    assert plan.transfers, "every case moves bytes"
    assert hashlib.sha256(canonical(plan).encode()).hexdigest() == PINNED[case]


def test_cases_are_all_pinned() -> None:
    assert sorted(PINNED) == sorted(CASES)
