"""Sharded plans with real processes: trainer ranks (this process is rank 0, the others are
subprocesses) holding FSDP or TP shards push into `weightsync serve` workers over gloo;
and a TP=2 destination made of two rank processes receiving only their shards."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from tests.helpers import TINY, WorkerProcess, free_port, paused_clients, perturbed, run, served_workers
from weightsync.core import errors
from weightsync.core.plan.layouts import TrainerLayout
from weightsync.core.plan.value import max_sender_share, receiver_excess
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer.client import WorkerClient
from weightsync.trainer.sharded import ShardedPusher, ShardedPushFailed
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.sink import dtype_name

pytestmark = [pytest.mark.slow, pytest.mark.integration]

RANK = """
import sys, json, torch
from tests.helpers import TINY, perturbed
from weightsync.core.plan.layouts import TrainerLayout
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer.sharded import ShardedPusher
from weightsync.transports.sink import dtype_name
from weightsync.core.snapshot import TensorSpec
rank, ranks, sharding, port, seeds, lie, timeout_s = (int(sys.argv[1]), int(sys.argv[2]),
    sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]), sys.argv[6], float(sys.argv[7]))
base = ReferenceEngine(TINY).model.weights()
specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in base.items()]
layout = getattr(TrainerLayout, sharding)(specs, ranks)
p = ShardedPusher(rank, layout, master_port=port, timeout_s=timeout_s, bucket_bytes=16 << 10).connect()
for seed in seeds:
    full = perturbed(base, seed=seed)
    held = {}
    for name, boxes in layout.held_by(rank).items():
        held[name] = full[name][tuple(slice(a, b) for a, b in boxes[0].bounds)].contiguous()
    if lie == "die":  # send half of its messages, then die
        import os
        import weightsync.trainer.sharded_step as ts
        real_send = ts.send
        def dying(group, transfers, specs, held, go=None):
            real_send(group, transfers[: len(transfers) // 2], specs, held, go)
            os._exit(3)
        ts.send = dying
    if lie == "checksum":  # post a wrong hash for every piece it sends (records: index, position, hash)
        import weightsync.trainer.sharded_step as ts
        real_send = getattr(ts.send, "real", ts.send)
        def lying(*args):
            sums = real_send(*args)
            return bytes(b ^ 0xFF if i % 24 >= 16 else b for i, b in enumerate(sums))
        lying.real = real_send
        ts.send = lying
    if lie == "short":
        import weightsync.transports.plan.protocol as sh
        real_manifest = sh.manifest
        import weightsync.trainer.sharded_step as ts
        ts.manifest = lambda transfers: real_manifest(transfers)[:-16] + b"\\0" * 16
    if lie == "late":  # post its manifest a second after it learns the step
        import time
        import weightsync.trainer.sharded_step as ts
        real_manifest = ts.manifest
        def late(transfers):
            time.sleep(1)
            return real_manifest(transfers)
        ts.manifest = late
    try:
        p.push(held)
    except Exception as exc:
        print("push failed:", exc, file=sys.stderr)
p.close()
"""


def specs_of(weights):
    from weightsync.core.snapshot import TensorSpec

    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in weights.items()]


BASE = ReferenceEngine(TINY).model.weights()
SPECS = specs_of(BASE)


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    with served_workers(2) as procs:
        yield procs


@pytest.fixture
def clients(workers: list[WorkerProcess]) -> Iterator[list[WorkerClient]]:
    with paused_clients(workers) as cs:  # each test starts from a healthy, paused worker
        yield cs


def held_by(layout: TrainerLayout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        n: full[n][tuple(slice(a, b) for a, b in boxes[0].bounds)].contiguous()
        for n, boxes in layout.held_by(rank).items()
    }


def others(
    ranks: int, sharding: str, port: int, seeds: list[int], lie: str = "-", timeout_s: float = 40
) -> list[subprocess.Popen]:
    import json

    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(RANK),
                str(r),
                str(ranks),
                sharding,
                str(port),
                json.dumps(seeds),
                lie if r == 1 else "-",
                str(timeout_s),
            ],
            stderr=subprocess.PIPE,
        )
        for r in range(1, ranks)
    ]


def fresh_output(weights: dict[str, torch.Tensor]) -> list[int]:
    async def go() -> list[int]:
        engine = ReferenceEngine(TINY)
        for name, t in engine.model.weights().items():
            t.copy_(weights[name])
        out = await engine.generate(list(b"sharded"), max_tokens=12)
        await engine.close()
        return out.token_ids

    return run(go())


@pytest.mark.parametrize(("sharding", "ranks"), [("fsdp", 3), ("tp", 2)])
def test_trainer_shards_make_every_worker_bit_exact(
    clients: list[WorkerClient], sharding: str, ranks: int
) -> None:
    layout = getattr(TrainerLayout, sharding)(SPECS, ranks)
    port = free_port()
    procs = others(ranks, sharding, port, [21])
    new = perturbed(BASE, seed=21)
    try:
        p = ShardedPusher(
            0,
            layout,
            workers=[c.base_url for c in clients],
            master_port=port,
            timeout_s=40,
            bucket_bytes=16 << 10,
        ).connect()
        plan = p.plan
        assert max_sender_share(plan) <= 1.1 / ranks  # the busiest source within 1.1x its fair share
        assert receiver_excess(plan) < 1.02  # nobody receives what it does not serve
        replies = p.push(held_by(layout, 0, new), version=f"{sharding}-1")
        p.close()
    finally:
        for proc in procs:
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err.decode()
    expected = tensor_hashes(new.items())
    want = fresh_output(new)
    for c in clients:
        assert replies[c.base_url]["version"] == f"{sharding}-1"
        assert c.engine_rpc("weight_hashes")["result"] == expected
        c.resume_generation()
        assert c.complete("sharded", max_tokens=12)["choices"][0]["token_ids"] == want
        c.pause_generation()


@pytest.mark.parametrize("lie", ["checksum", "die", "short"])
def test_a_lying_or_dying_source_is_never_committed(clients: list[WorkerClient], lie: str) -> None:
    layout = TrainerLayout.fsdp(SPECS, 2)
    port = free_port()
    before = [c.get_weight_version() for c in clients]
    procs = others(2, "fsdp", port, [31], lie)
    try:
        p = ShardedPusher(
            0,
            layout,
            workers=[c.base_url for c in clients],
            master_port=port,
            timeout_s=40,
            bucket_bytes=16 << 10,
        ).connect()
        with pytest.raises((ShardedPushFailed, errors.WeightSyncError)) as exc:
            p.push(held_by(layout, 0, perturbed(BASE, seed=31)), version="lie")
        p.close()
    finally:
        for proc in procs:
            proc.communicate(timeout=90)
    for c, old in zip(clients, before, strict=True):
        state = c.get_weight_version()
        assert state["version"] == old["version"]  # never committed
        assert c.liveness_probe()["alive"]  # never a dead worker
        if lie == "short":  # refused before any write: the state is as it was
            assert state["torn"] == old["torn"]
        else:
            assert state["torn"]  # bytes moved and cannot be vouched for
    if lie == "short":
        assert isinstance(exc.value, ShardedPushFailed)
        assert all(not getattr(e, "wrote", False) for e in exc.value.failures.values())
    if isinstance(exc.value, ShardedPushFailed):
        codes = {e.code for e in exc.value.failures.values()}
        assert codes <= {
            "checksum_mismatch",
            "stream_failed",
            "stream_mismatch",
            "stream_aborted",
            "weights_torn",
        }


def test_a_source_that_posts_its_manifest_late_is_waited_for(clients: list[WorkerClient]) -> None:
    # Trainer rank 0 asks the workers only once every rank's manifest is in the store: a
    # worker that looked before would refuse the plan (stream_mismatch) for a slow rank.
    layout = TrainerLayout.fsdp(SPECS, 2)
    port = free_port()
    new = perturbed(BASE, seed=37)
    procs = others(2, "fsdp", port, [37], "late")
    try:
        with ShardedPusher(
            0, layout, workers=[c.base_url for c in clients], master_port=port, timeout_s=40,
            bucket_bytes=16 << 10,
        ) as p:  # fmt: skip
            replies = p.push(held_by(layout, 0, new), version="late")
    finally:
        for proc in procs:
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err.decode()
    expected = tensor_hashes(new.items())
    for c in clients:
        assert replies[c.base_url]["version"] == "late"
        assert c.engine_rpc("weight_hashes")["result"] == expected


def test_a_plan_that_mismatches_the_worker_is_refused_before_any_write(clients: list[WorkerClient]) -> None:
    """A part made for a TP=2 rank (half of each sharded tensor) sent to a one-process worker
    that serves every tensor whole is 400 layout_mismatch, nothing written; the group stays
    in step and the next good plan commits."""
    from weightsync.core.plan.build import make_plan
    from weightsync.core.plan.layouts import FleetLayout, WorkerLayout, tp_dims

    layout = TrainerLayout.whole(SPECS, 1)
    p = ShardedPusher(0, layout, workers=[c.base_url for c in clients], master_port=free_port(), timeout_s=40)
    p.connect()
    try:
        tp2 = FleetLayout(
            (WorkerLayout.tensor_parallel("w", SPECS, 2, tp_dims(SPECS, shard_embeddings=False)),)
        )
        wrong = make_plan(layout, tp2).part(0)
        assert (wrong.rank_offset, wrong.world_size) == (1, 3)  # where clients[0] really sits
        c = clients[0]
        before = (c.engine_rpc("weight_hashes")["result"], c.get_weight_version())
        with pytest.raises(errors.InvalidRequest) as exc:
            c.update_weights_from_plan(p.group_name, "s1", wrong.to_wire())
        assert exc.value.code == "layout_mismatch"
        with pytest.raises(errors.InvalidRequest) as exc:
            c.update_weights_from_plan(p.group_name, "s2", {"format": "weightsync.plan_part/1"})
        assert exc.value.code == "invalid_layout"
        assert (c.engine_rpc("weight_hashes")["result"], c.get_weight_version()) == before
        new = perturbed(BASE, seed=51)
        p.push(new, version="after-refusal")
    finally:
        p.close()
    for c in clients:
        state = c.get_weight_version()
        assert state["version"] == "after-refusal" and not state["torn"]
        assert c.engine_rpc("weight_hashes")["result"] == tensor_hashes(new.items())


RECEIVER = """
import sys, json, torch
from weightsync.core.plan.value import PlanPart
from weightsync.core.plan.boxes import Box
from weightsync.transports.distributed.group import create_group
from weightsync.transports.plan.receive import check_manifests, handshake, receive
from weightsync.core.snapshot import TensorSpec
port, rank, part, served = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
part = PlanPart.from_wire(part)
specs = {s.name: s for s in part.tensors}
boxes = {n: Box(tuple(tuple(b) for b in v)) for n, v in served.items()}
local = {n: (torch.zeros(boxes[n].shape, dtype=getattr(torch, specs[n].dtype)), boxes[n]) for n in specs}
g = create_group("p", master_address="127.0.0.1", master_port=port, rank=part.rank_offset + rank,
                 world_size=part.world_size, backend="gloo", timeout_s=60)
mine = part.for_rank(rank)
check_manifests(g, "s", mine)
handshake(g, "s")
for _ in receive(g, "s", mine, specs, local, lambda: None):
    pass
got = sum(t.size for t in mine)
torch.save({n: t for n, (t, _) in local.items()}, sys.argv[5])
print(got)
"""


def test_a_tp2_destination_of_two_rank_processes_receives_only_its_shards(tmp_path) -> None:
    """Six processes: three trainer ranks (FSDP) send to a TP=2 worker (two rank processes)
    and a TP=1 worker; each rank ends bit-exact with its shard of the new weights and has
    received exactly the bytes of what it serves."""
    import datetime
    import json

    import torch.distributed as dist

    from weightsync.core.plan.build import make_plan
    from weightsync.core.plan.layouts import FleetLayout, WorkerLayout, tp_dims
    from weightsync.transports.distributed.group import create_group
    from weightsync.transports.plan.protocol import go_key, manifest, manifest_key, sums_key
    from weightsync.transports.plan.send import send

    ranks = 3
    layout = TrainerLayout.fsdp(SPECS, ranks)
    fleet = FleetLayout(
        (
            WorkerLayout.tensor_parallel("tp2", SPECS, 2, tp_dims(SPECS, shard_embeddings=False)),
            WorkerLayout.replica("tp1", SPECS),
        )
    )
    plan = make_plan(layout, fleet, 16 << 10)
    new = perturbed(BASE, seed=41)
    specs = {s.name: s for s in SPECS}
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    # The sources' manifests are posted before any receiver looks for them, as a trainer
    # posts them before it asks the workers to update.
    for s in range(ranks):
        store.set(manifest_key("s", s), manifest(plan.for_source(s)))
    dests = [(0, 0), (0, 1), (1, 0)]
    receivers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(RECEIVER),
                str(store.port),
                str(r),
                json.dumps(plan.part(w).to_wire()),
                json.dumps({n: b.to_wire() for n, b in fleet.workers[w].served(r).items()}),
                str(tmp_path / f"{w}-{r}.pt"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w, r in dests
    ]
    import threading

    groups = {}

    def join(rank: int) -> None:
        groups[rank] = create_group(
            "p", master_address="127.0.0.1", master_port=store.port, rank=rank, world_size=plan.world_size,
            backend="gloo", timeout_s=90, store=store if rank == 0 else None,
        )  # fmt: skip

    threads = [threading.Thread(target=join, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(groups) != ranks:
        for p in receivers:
            p.kill()
        pytest.fail("the group did not form: " + " | ".join(p.communicate()[1][-2000:] for p in receivers))
    groups[0].store.set(go_key("s"), b"1")

    def source(s: int) -> None:
        held = {
            n: (new[n][tuple(slice(a, b) for a, b in boxes[0].bounds)].contiguous(), boxes[0])
            for n, boxes in layout.held_by(s).items()
        }
        groups[s].store.set(sums_key("s", s), send(groups[s], plan.for_source(s), specs, held))

    threads = [threading.Thread(target=source, args=(s,)) for s in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outs = [p.communicate(timeout=60) for p in receivers]
    for (w, r), p, (out, err) in zip(dests, receivers, outs, strict=True):
        assert p.returncode == 0, err
        assert int(out) == sum(t.size for t in plan.transfers if (t.worker, t.rank) == (w, r))
        assert int(out) < plan.needed_bytes(w, r) * 1.02  # only what it serves (+ alignment)
        got = torch.load(tmp_path / f"{w}-{r}.pt")
        for n, box in fleet.workers[w].served(r).items():
            want = new[n][tuple(slice(a, b) for a, b in box.bounds)]
            assert torch.equal(got[n], want), (w, r, n)
    for g in groups.values():
        g.close()
