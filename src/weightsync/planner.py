"""``weightsync plan``: a transfer plan's summary and, with link figures, its predicted time.

>>> weightsync plan --model-config qwen2.5-0.5b --trainer-ranks 4 --trainer-sharding fsdp \\
...     --worker-tp 2 --worker-tp 1 --json

prints ``{"total_bytes", "rounds", "transfers", "senders": [{"rank", "bytes"}], "receivers":
[{"worker", "rank", "bytes", "needed_bytes"}]}``.  ``--simulate --link-gbps G
[--ranks-per-node K]`` adds ``"predicted_s"`` (and the terms it is made of) from the cost
model of :func:`predict`; ``--model-bytes B`` plans a model described only by its size.

Worker shards follow the reference engine's TP rule (column-parallel projections on dim 0,
row-parallel on dim 1, embeddings and norms whole); ``--shard-embeddings`` shards
embeddings on dim 0 as vLLM's vocab-parallel layers do.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from weightsync.core.errors import WeightSyncError
from weightsync.core.plan.build import make_plan
from weightsync.core.plan.layouts import FleetLayout, TrainerLayout, WorkerLayout, tp_dims
from weightsync.core.plan.value import Plan
from weightsync.core.snapshot import TensorSpec

CONFIGS = ("default", "tiny", "qwen2.5-0.5b")

LATENCY_US = 30.0
"""Default per-message cost (one point-to-point send on a busy rank): NCCL's small-message
latency on NVLink/InfiniBand is 10-30 us; on gloo over loopback here it measures ~100 us."""

SETUP_S = 0.05
"""Default fixed cost of one update: the workers' plan checks, the store handshake (ready /
go / checksums) and the HTTP round trip; measured at 30-60 ms on this machine's gloo runs."""


def reference_specs(name: str) -> list[TensorSpec]:
    """The tensors of a reference-engine config, in the engine's order (no weights built)."""
    from weightsync.engines.reference import ModelConfig

    builders: dict[str, Any] = {
        "default": ModelConfig,
        "tiny": ModelConfig.tiny,
        "qwen2.5-0.5b": ModelConfig.qwen2_5_0_5b,
    }
    c = builders[name]()
    h, kv, i = c.hidden_size, c.num_kv_heads * c.head_dim, c.intermediate_size
    out = [TensorSpec("model.embed_tokens.weight", c.dtype, (c.vocab_size, h))]
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        out.append(TensorSpec(p + "input_layernorm.weight", c.dtype, (h,)))
        for proj, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            out.append(TensorSpec(p + f"self_attn.{proj}.weight", c.dtype, (rows, h)))
            if c.qkv_bias:
                out.append(TensorSpec(p + f"self_attn.{proj}.bias", c.dtype, (rows,)))
        out.append(TensorSpec(p + "self_attn.o_proj.weight", c.dtype, (h, h)))
        out.append(TensorSpec(p + "post_attention_layernorm.weight", c.dtype, (h,)))
        out.append(TensorSpec(p + "mlp.gate_proj.weight", c.dtype, (i, h)))
        out.append(TensorSpec(p + "mlp.up_proj.weight", c.dtype, (i, h)))
        out.append(TensorSpec(p + "mlp.down_proj.weight", c.dtype, (h, i)))
    out.append(TensorSpec("model.norm.weight", c.dtype, (h,)))
    if not c.tie_embeddings:
        out.append(TensorSpec("lm_head.weight", c.dtype, (c.vocab_size, h)))
    return out


def described_specs(model_bytes: int, *, hidden: int = 8192, layers: int = 64) -> list[TensorSpec]:
    """A model known only by its size: ``layers`` column-parallel bf16 ``[rows, hidden]``
    matrices (rows a multiple of 1024, so every TP up to 1024 divides them) of equal size,
    summing to ``model_bytes`` rounded up to a whole number of 1024-row blocks.  A plan's
    predicted time depends on the bytes per link, not on the shapes, so this stands for any
    model of that size."""
    rows = max(1024, -(-model_bytes // (2 * hidden * layers * 1024)) * 1024)
    return [
        TensorSpec(f"model.layers.{n}.mlp.up_proj.weight", "bfloat16", (rows, hidden)) for n in range(layers)
    ]


def trainer_layout(specs: Sequence[TensorSpec], ranks: int, sharding: str) -> TrainerLayout:
    builders = {
        "whole": TrainerLayout.whole,
        "fsdp": TrainerLayout.fsdp,
        "tp": TrainerLayout.tp,
        "replicated": TrainerLayout.replicated,
    }
    return builders[sharding](specs, ranks)


def fleet_layout(
    specs: Sequence[TensorSpec], tps: Sequence[int], *, shard_embeddings: bool = False
) -> FleetLayout:
    dims = tp_dims(specs, shard_embeddings=shard_embeddings)
    return FleetLayout(
        tuple(WorkerLayout.tensor_parallel(f"worker-{w}", specs, tp, dims) for w, tp in enumerate(tps))
    )


@attrs.frozen
class LinkModel:
    """``link_gbps`` GB/s (10^9 bytes/s) per link, shared by ``ranks_per_node`` consecutive
    ranks (trainer ranks in order; each worker's ranks in order, a worker starting a new node).
    ``latency_us`` per message on the busiest rank, ``setup_s`` once per update."""

    link_gbps: float
    ranks_per_node: int = 1
    latency_us: float = LATENCY_US
    setup_s: float = SETUP_S


def predict(plan: Plan, model: LinkModel) -> dict[str, float]:
    """The cost model: ``predicted_s = setup_s + max(busiest source node's egress, busiest
    destination node's ingress) / link + latency_us * (messages on the busiest rank)``.

    Every flow of a round runs at once on disjoint links (see :mod:`weightsync.core.plan.build`), so
    the wire time is set by the most loaded node link; a link carries at most its bandwidth
    whatever the number of flows through it."""
    k = model.ranks_per_node
    egress: dict[int, int] = {}
    ingress: dict[tuple[int, int], int] = {}
    messages: dict[tuple[str, int, int], int] = {}
    for t in plan.transfers:
        egress[t.src // k] = egress.get(t.src // k, 0) + t.size
        node = (t.worker, t.rank // k)
        ingress[node] = ingress.get(node, 0) + t.size
        for end in (("src", t.src, 0), ("dst", t.worker, t.rank)):
            messages[end] = messages.get(end, 0) + 1
    rate = model.link_gbps * 1e9
    wire = max(max(egress.values(), default=0), max(ingress.values(), default=0)) / rate
    fixed = model.latency_us * 1e-6 * max(messages.values(), default=0)
    return {
        "predicted_s": model.setup_s + wire + fixed,
        "wire_s": wire,
        "latency_s": fixed,
        "setup_s": model.setup_s,
        "max_node_egress_bytes": max(egress.values(), default=0),
        "max_node_ingress_bytes": max(ingress.values(), default=0),
    }


def add_parser(sub: Any) -> None:
    """Add ``plan`` to the top-level subparsers ``sub``."""
    p = sub.add_parser(
        "plan",
        help="print a sharded transfer plan's summary (and predicted time with --simulate)",
        description="Plan moving a trainer's sharded weights into workers' TP shards; exit 0, or 2 for "
        "bad arguments (a JSON error object with --json).",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model-config", choices=CONFIGS, help="a reference-engine model's tensors")
    what.add_argument(
        "--model-bytes",
        type=_byte_count,
        metavar="B",
        help="a model described by its size (2000000000000 or 2e12)",
    )
    p.add_argument("--trainer-ranks", type=_positive_int, required=True, metavar="M", help="trainer ranks")
    p.add_argument(
        "--trainer-sharding",
        choices=["whole", "fsdp", "tp", "replicated"],
        required=True,
        help="whole tensors per rank, dim-0 shards, Megatron TP shards, or full copies",
    )
    p.add_argument(
        "--worker-tp",
        type=_positive_int,
        action="append",
        required=True,
        metavar="T",
        help="one worker of tensor-parallel size T (repeat per worker)",
    )
    p.add_argument("--shard-embeddings", action="store_true", help="workers shard embeddings on dim 0")
    p.add_argument("--bucket-bytes", type=_positive_int, default=32 << 20, help="largest packed message")
    p.add_argument("--simulate", action="store_true", help="add predicted_s from the cost model")
    p.add_argument("--link-gbps", type=_positive_float, metavar="G", help="GB/s per link (per node with -K)")
    p.add_argument(
        "--ranks-per-node", type=_positive_int, default=1, metavar="K", help="ranks sharing one node link"
    )
    p.add_argument(
        "--latency-us", type=_nonnegative_float, default=LATENCY_US, help="cost model: per message"
    )
    p.add_argument("--setup-s", type=_nonnegative_float, default=SETUP_S, help="cost model: per update")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _byte_count(text: str) -> int:
    """A positive whole number of bytes, written as an integer or in exponent form (``2e12``)."""
    try:
        return _positive_int(text)
    except ValueError:
        pass
    value = _positive_float(text)
    if value != int(value) or value > 1 << 62:
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes, got {text}")
    return int(value)


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.simulate and args.link_gbps is None:
        return _fail(args, "--simulate needs --link-gbps", "invalid_value")
    try:
        specs = reference_specs(args.model_config) if args.model_config else described_specs(args.model_bytes)
        plan = make_plan(
            trainer_layout(specs, args.trainer_ranks, args.trainer_sharding),
            fleet_layout(specs, args.worker_tp, shard_embeddings=args.shard_embeddings),
            args.bucket_bytes,
        )
    except WeightSyncError as exc:
        return _fail(args, exc.message, exc.code)
    out = plan.summary()
    if args.simulate:
        out.update(
            predict(plan, LinkModel(args.link_gbps, args.ranks_per_node, args.latency_us, args.setup_s))
        )
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['total_bytes'] / 1e9:.3f} GB in {out['transfers']} messages over {out['rounds']} rounds")
    for s in out["senders"]:
        print(f"  trainer rank {s['rank']}: sends {s['bytes'] / 1e9:.3f} GB")
    for r in out["receivers"]:
        print(
            f"  worker {r['worker']} rank {r['rank']}: receives {r['bytes'] / 1e9:.3f} GB "
            f"(serves {r['needed_bytes'] / 1e9:.3f} GB)"
        )
    if args.simulate:
        print(f"predicted: {out['predicted_s']:.3f} s (wire {out['wire_s']:.3f} s)")
    return 0


def _fail(args: argparse.Namespace, message: str, code: str) -> int:
    if args.json:
        print(json.dumps({"status": "error", "code": code, "message": message}))
    print(f"weightsync plan: {message}", file=sys.stderr)
    return 2
