"""The pure planner: layouts as validated data, and plans that deliver every served byte
exactly once, nothing else, balanced across sources, deterministically."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.core.dtypes import itemsize
from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.build import make_plan
from weightsync.core.plan.check import check_part
from weightsync.core.plan.layouts import (
    FleetLayout,
    Holding,
    TensorLayout,
    TrainerLayout,
    WorkerLayout,
    tp_dims,
)
from weightsync.core.plan.value import PlanPart, max_sender_share, receiver_excess
from weightsync.core.snapshot import TensorSpec
from weightsync.planner import LinkModel, fleet_layout, predict, reference_specs, trainer_layout

pytestmark = pytest.mark.unit

QWEN = reference_specs("qwen2.5-0.5b")
TINY = reference_specs("tiny")


def delivered_runs(plan, worker: int, rank: int) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of each full tensor that reach (worker, rank), sorted."""
    specs = {s.name: s for s in plan.trainer.specs}
    out: dict[str, list[tuple[int, int]]] = {}
    for t in plan.transfers:
        if (t.worker, t.rank) != (worker, rank):
            continue
        for p in t.pieces:
            s = specs[p.name]
            out.setdefault(p.name, []).extend(p.box.runs(s.shape, itemsize(s.dtype)))
    return {n: sorted(r) for n, r in out.items()}


def served_runs(plan, worker: int, rank: int) -> dict[str, list[tuple[int, int]]]:
    served = plan.fleet.workers[worker].served(rank)
    return {
        s.name: served[s.name].runs(s.shape, itemsize(s.dtype))
        for s in plan.trainer.specs
        if math.prod(s.shape)
    }


def merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, n in sorted(runs):
        assert not out or off >= out[-1][0] + out[-1][1], f"byte range {off}+{n} delivered twice"
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def assert_exact(plan) -> None:
    """Every byte a destination serves arrives exactly once, and no other byte."""
    for w, wl in enumerate(plan.fleet.workers):
        for r in range(wl.world_size):
            got = {n: merge(runs) for n, runs in delivered_runs(plan, w, r).items()}
            want = {n: merge(runs) for n, runs in served_runs(plan, w, r).items()}
            assert got == want, f"worker {w} rank {r}"


@pytest.mark.parametrize("sharding", ["fsdp", "tp", "replicated", "whole"])
@pytest.mark.parametrize(("ranks", "tps"), [(2, (2, 1)), (3, (2, 2, 1)), (3, (1,))])
def test_every_served_byte_is_delivered_exactly_once(sharding, tps, ranks):
    plan = make_plan(trainer_layout(TINY, ranks, sharding), fleet_layout(TINY, tps))
    assert_exact(plan)
    assert receiver_excess(plan) < 1.01  # 64-byte alignment padding only


@pytest.mark.parametrize("sharding", ["fsdp", "tp", "replicated"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_busiest_sender_is_within_a_tenth_of_its_fair_share(sharding, ranks):
    plan = make_plan(trainer_layout(QWEN, ranks, sharding), fleet_layout(QWEN, (2, 1)))
    assert max_sender_share(plan) <= 1.1 / ranks


def test_whole_tensors_are_sent_by_their_owner_and_balance_by_the_layout():
    """Owned tensors can only come from their owner: each rank sends exactly what the
    destinations serve of its tensors, and the largest-first layout keeps that balanced
    when no single tensor dominates."""
    specs = [TensorSpec(f"t{i}", "float32", (64 + i, 32)) for i in range(40)]
    layout = TrainerLayout.whole(specs, 3)
    plan = make_plan(layout, fleet_layout(specs, (1, 1)))
    owner = {t.spec.name: t.holdings[0].ranks[0] for t in layout.tensors}
    for t in plan.transfers:
        assert all(owner[p.name] == t.src for p in t.pieces)
    assert max_sender_share(plan) <= 1.1 / 3


def test_the_plan_is_deterministic_and_cached_until_a_layout_changes():
    t, f = trainer_layout(QWEN, 3, "fsdp"), fleet_layout(QWEN, (2, 1))
    a = make_plan(t, f)
    assert make_plan(t, f) is a  # cached
    again = make_plan(trainer_layout(QWEN, 3, "fsdp"), fleet_layout(QWEN, (2, 1)))
    assert again == a and [p.to_wire() for p in map(again.part, range(2))] == [
        a.part(w).to_wire() for w in range(2)
    ]
    changed = make_plan(trainer_layout(QWEN, 2, "fsdp"), f)
    assert changed != a


def test_a_qwen_sized_plan_delivers_exactly_what_each_tp_rank_serves():
    plan = make_plan(trainer_layout(QWEN, 3, "fsdp"), fleet_layout(QWEN, (2, 1)))
    assert_exact(plan)


def test_the_cli_prints_the_summary_and_is_deterministic():
    cmd = [sys.executable, "-m", "weightsync", "plan", "--model-config", "tiny", "--trainer-ranks", "3",
           "--trainer-sharding", "fsdp", "--worker-tp", "2", "--worker-tp", "1", "--json"]  # fmt: skip
    outs = [subprocess.run(cmd, capture_output=True, text=True, check=True).stdout for _ in range(2)]
    assert outs[0] == outs[1]
    summary = json.loads(outs[0])
    assert set(summary) >= {"total_bytes", "rounds", "senders", "receivers"}
    assert [s["rank"] for s in summary["senders"]] == [0, 1, 2]
    assert [(r["worker"], r["rank"]) for r in summary["receivers"]] == [(0, 0), (0, 1), (1, 0)]
    assert summary["total_bytes"] == sum(s["bytes"] for s in summary["senders"])
    assert summary == make_plan(trainer_layout(TINY, 3, "fsdp"), fleet_layout(TINY, (2, 1))).summary()
    for r in summary["receivers"]:
        assert r["needed_bytes"] <= r["bytes"] < r["needed_bytes"] * 1.01


def test_the_cli_simulates_a_described_model_and_refuses_bad_arguments():
    cmd = [sys.executable, "-m", "weightsync", "plan", "--model-bytes", "8000000000", "--trainer-ranks", "8",
           "--trainer-sharding", "fsdp", "--worker-tp", "4", "--worker-tp", "4", "--simulate",
           "--link-gbps", "50", "--ranks-per-node", "4", "--json"]  # fmt: skip
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    # each worker is one node of 4 ranks receiving the whole model: its ingress bounds the time
    assert out["max_node_ingress_bytes"] >= 8e9
    assert out["predicted_s"] == pytest.approx(out["setup_s"] + out["wire_s"] + out["latency_s"])
    assert out["wire_s"] == pytest.approx(out["max_node_ingress_bytes"] / 50e9)
    bad = subprocess.run([*cmd[:-6], "--simulate", "--json"], capture_output=True, text=True)
    assert bad.returncode == 2 and json.loads(bad.stdout)["code"] == "invalid_value"
    odd = subprocess.run(
        [sys.executable, "-m", "weightsync", "plan", "--model-config", "tiny", "--trainer-ranks", "2",
         "--trainer-sharding", "fsdp", "--worker-tp", "3", "--json"], capture_output=True, text=True,
    )  # fmt: skip
    assert odd.returncode == 2 and json.loads(odd.stdout)["code"] == "invalid_layout"


def test_model_bytes_may_be_written_in_exponent_form_but_must_be_a_whole_positive_count():
    def plan(size: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "weightsync", "plan", "--model-bytes", size, "--trainer-ranks", "2",
               "--trainer-sharding", "fsdp", "--worker-tp", "2", "--json"]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True)

    assert json.loads(plan("2e9").stdout) == json.loads(plan("2000000000").stdout)
    for bad in ("1.5", "0", "-2e9", "nan", "inf", "two"):
        refused = plan(bad)
        assert refused.returncode == 2 and "--model-bytes" in refused.stderr, (bad, refused.stderr)


def test_the_cost_model_reproduces_the_bandwidth_bound_of_a_sharded_fleet():
    """Kimi-K2-sized (2 TB) from 256 ranks into 4 TP32 replicas at 400 GB/s per 8-GPU node:
    every replica node ingests a quarter of the model, 500 GB, so the wire takes 1.25 s."""
    from weightsync.planner import described_specs

    specs = described_specs(2_000_000_000_000, layers=16)
    plan = make_plan(trainer_layout(specs, 256, "fsdp"), fleet_layout(specs, (32,) * 4))
    p = predict(plan, LinkModel(400, 8))
    assert p["wire_s"] == pytest.approx(plan.summary()["total_bytes"] / 4 / 4 / 400e9, rel=1e-3)
    assert max_sender_share(plan) <= 1.1 / 256


def test_reference_specs_match_the_engine():
    from weightsync.engines.reference import ModelConfig
    from weightsync.engines.reference.model import CausalLM
    from weightsync.transports.sink import dtype_name

    weights = CausalLM(ModelConfig.tiny(), slots=1).weights()
    assert [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in weights.items()] == TINY


# ---------------------------------------------------------------------------- layouts as data


def test_layouts_round_trip_through_their_wire_form():
    t = trainer_layout(TINY, 3, "tp")
    f = fleet_layout(TINY, (2, 1))
    assert TrainerLayout.from_wire(json.loads(json.dumps(t.to_wire()))) == t
    assert FleetLayout.from_wire(json.loads(json.dumps(f.to_wire()))) == f
    part = make_plan(t, f).part(0)
    assert PlanPart.from_wire(json.loads(json.dumps(part.to_wire()))) == part
    assert PlanPart.from_wire(json.loads(json.dumps(part.to_wire(compact=False)))) == part


@pytest.mark.parametrize(
    "mutate",
    [
        lambda w: w.update(format="weightsync.trainer_layout/9"),
        lambda w: w.update(ranks=0),
        lambda w: w.update(ranks=True),
        lambda w: w.update(extra=1),
        lambda w: w["tensors"][0].update(dtype="int4"),
        lambda w: w["tensors"][0]["holdings"].pop(),  # a gap
        lambda w: w["tensors"][0]["holdings"][0]["ranks"].append(99),  # rank out of range
        lambda w: w["tensors"][0]["holdings"][0].update(box=[[0, 1]]),  # wrong rank of box
        lambda w: w["tensors"][0]["holdings"][1].update(box=w["tensors"][0]["holdings"][0]["box"]),  # overlap
        lambda w: w["tensors"][0]["holdings"][0]["box"][0].__setitem__(1, 10**9),  # outside
        lambda w: w["tensors"].append(w["tensors"][0]),  # twice
    ],
)
def test_a_malformed_trainer_layout_is_refused_with_a_code(mutate):
    wire = json.loads(json.dumps(trainer_layout(TINY, 3, "fsdp").to_wire()))
    mutate(wire)
    with pytest.raises(InvalidRequest) as exc:
        TrainerLayout.from_wire(wire)
    assert exc.value.code == "invalid_layout"


def test_a_worker_that_lacks_a_tensor_or_disagrees_on_its_shape_is_a_layout_mismatch():
    t = trainer_layout(TINY, 2, "fsdp")
    short = FleetLayout((WorkerLayout.replica("w", TINY[1:]),))
    with pytest.raises(InvalidRequest) as exc:
        make_plan(t, short)
    assert exc.value.code == "layout_mismatch"
    other = [TensorSpec(s.name, "float16", s.shape) for s in TINY]
    with pytest.raises(InvalidRequest) as exc:
        make_plan(t, FleetLayout((WorkerLayout.replica("w", other),)))
    assert exc.value.code == "layout_mismatch"


# ---------------------------------------------------------------------------- a worker checks its part


def _tamper(part: PlanPart, **changes) -> PlanPart:
    import attrs

    t = part.transfers[0]
    p = t.pieces[0]
    piece = attrs.evolve(p, **{k: v for k, v in changes.items() if k in ("box", "nbytes", "offset", "name")})
    transfer = attrs.evolve(
        t, pieces=(piece, *t.pieces[1:]), **{k: v for k, v in changes.items() if k in ("rank", "size")}
    )
    return attrs.evolve(part, transfers=(transfer, *part.transfers[1:]))


def test_a_worker_accepts_its_own_part_and_refuses_any_part_that_is_not_its_layout():
    t = trainer_layout(TINY, 3, "fsdp")
    f = fleet_layout(TINY, (2, 1))
    plan = make_plan(t, f)
    w = f.workers[0]
    served = [w.served(r) for r in range(w.world_size)]
    check_part(plan.part(0), served, w.tensors)
    # the same part checked against a TP=1 worker: rank 0 would get half of what it serves
    with pytest.raises(InvalidRequest, match="rank 1"):
        check_part(plan.part(0), [f.workers[1].served(0)], f.workers[1].tensors)
    # a TP=1 worker's part sent to the TP=2 worker: bytes it does not serve
    flipped = make_plan(t, fleet_layout(TINY, (1, 2)))
    with pytest.raises(InvalidRequest, match="does not serve"):
        check_part(flipped.part(0), served, w.tensors)
    part = plan.part(0)
    p = part.transfers[0].pieces[0]
    for bad in (
        _tamper(part, nbytes=p.nbytes + 4),
        _tamper(part, offset=part.transfers[0].size),
        _tamper(part, size=part.transfers[0].size + 8),
    ):
        with pytest.raises(InvalidRequest) as exc:
            check_part(bad, served, w.tensors)
        assert exc.value.code == "layout_mismatch"


# ---------------------------------------------------------------------------- random layouts


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 5))
    specs = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.sampled_from([2, 4, 6, 8, 12]), min_size=1, max_size=3)))
        specs.append(
            TensorSpec(f"t{i}", draw(st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"])), shape)
        )
    ranks = draw(st.integers(1, 4))
    tensors = []
    for s in specs:
        kind = draw(st.sampled_from(["whole", "shard", "replicated", "hsdp"]))
        full = Box.full(s.shape)
        if kind == "whole":
            tensors.append(TensorLayout(s, (Holding(full, (draw(st.integers(0, ranks - 1)),)),)))
        elif kind == "replicated":
            tensors.append(TensorLayout(s, (Holding(full, tuple(range(ranks))),)))
        else:
            dim = draw(st.integers(0, len(s.shape) - 1))
            cuts = sorted(set(draw(st.lists(st.integers(1, s.shape[dim] - 1), max_size=3))))
            edges = [0, *cuts, s.shape[dim]]
            holdings = []
            for a, b in itertools.pairwise(edges):
                if kind == "shard":
                    rs = (draw(st.integers(0, ranks - 1)),)
                else:
                    rs = tuple(sorted(draw(st.sets(st.integers(0, ranks - 1), min_size=1))))
                holdings.append(Holding(Box.along(s.shape, dim, a, b), rs))
            tensors.append(TensorLayout(s, tuple(holdings)))
    trainer = TrainerLayout(ranks, tuple(tensors))
    workers = []
    for w in range(draw(st.integers(1, 3))):
        tp = draw(st.sampled_from([1, 2]))
        dims = {s.name: draw(st.sampled_from([None, *range(len(s.shape))])) for s in specs}
        workers.append(WorkerLayout.tensor_parallel(f"w{w}", specs, tp, dims))
    bucket = draw(st.sampled_from([64, 128, 4096]))
    return trainer, FleetLayout(tuple(workers)), bucket


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_random_layouts_deliver_exactly_what_is_served_and_each_part_checks(args):
    trainer, fleet, bucket = args
    plan = make_plan(trainer, fleet, bucket, split_bytes=16)
    assert_exact(plan)
    assert [t.index for t in plan.transfers] == list(range(len(plan.transfers)))
    for t in plan.transfers:
        assert t.buffer == -1 or t.size <= bucket
        held = trainer.held_by(t.src)
        for p in t.pieces:  # a source only sends what it holds
            assert any(p.box.within(b) for b in held[p.name])
    for w, wl in enumerate(fleet.workers):
        check_part(plan.part(w), [wl.served(r) for r in range(wl.world_size)], wl.tensors)
    again = make_plan.__wrapped__(trainer, fleet, bucket, split_bytes=16)
    assert again == plan


def test_tp_rule_shards_projections_and_keeps_norms_whole():
    dims = tp_dims(TINY, shard_embeddings=False)
    assert dims["model.layers.0.self_attn.q_proj.weight"] == 0
    assert dims["model.layers.0.self_attn.q_proj.bias"] == 0
    assert dims["model.layers.0.self_attn.o_proj.weight"] == 1
    assert dims["model.layers.0.mlp.down_proj.weight"] == 1
    assert dims["model.layers.0.input_layernorm.weight"] is None
    assert dims["model.embed_tokens.weight"] is None
    assert tp_dims(TINY, shard_embeddings=True)["model.embed_tokens.weight"] == 0


def test_box_runs_are_the_exact_byte_ranges_of_a_strided_shard():
    # a dim-1 shard of a [3, 4] float32 tensor: one 8-byte run per row
    assert Box(((0, 3), (2, 4))).runs((3, 4), 4) == [(8, 8), (24, 8), (40, 8)]
    assert Box(((1, 3), (0, 4))).runs((3, 4), 4) == [(16, 32)]  # a dim-0 shard is contiguous


def test_the_same_wire_gives_the_same_part_and_a_wire_of_other_types_is_still_refused():
    part = make_plan(trainer_layout(TINY, 2, "fsdp"), fleet_layout(TINY, (1,))).part(0)
    wire = json.loads(json.dumps(part.to_wire()))
    first = PlanPart.from_wire(wire)
    assert first == part
    assert PlanPart.from_wire(json.loads(json.dumps(wire))) is first  # parsed once per plan
    # equal to the last wire under ==, but not the same JSON: parsed, and refused
    for lie in (1.0 * wire["sources"], True if wire["sources"] == 1 else float(wire["sources"])):
        bad = {**wire, "sources": lie}
        assert bad == wire
        with pytest.raises(InvalidRequest) as exc:
            PlanPart.from_wire(bad)
        assert exc.value.code == "invalid_layout"
    # a piece moved: another part, parsed anew, and the worker's check refuses it
    moved = json.loads(json.dumps(wire))
    moved["transfers"][0]["offset"][0] += 4
    other = PlanPart.from_wire(moved)
    assert other != first
    served = [{s.name: Box.full(s.shape) for s in part.tensors}]
    check_part(first, served, part.tensors)
    with pytest.raises(InvalidRequest) as exc:
        check_part(other, served, part.tensors)
    assert exc.value.code == "layout_mismatch"
    check_part(first, served, part.tensors)  # the part that passed still passes
    with pytest.raises(InvalidRequest):  # and not against boxes it does not fit
        check_part(first, [{s.name: Box.full(s.shape) for s in part.tensors[1:]}], part.tensors)
