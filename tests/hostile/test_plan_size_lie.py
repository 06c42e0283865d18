"""A plan source that sends more bytes than its piece declared, against real ``weightsync
serve`` workers over a real multi-process gloo group (this process is trainer rank 0; rank 1
is a subprocess that sends 64 bytes too many in its first message to every worker rank).

gloo aborts whoever posted the receive when more bytes arrive than it asked for.  A plan's
receives are posted by a helper process that holds the worker rank's place in the group, so
the lie aborts the helper, never the worker (nor a tensor-parallel rank of it): the worker
answers ``503 peer_failed`` and keeps its old weights when the lie was the first message it
received (nothing written), is torn honestly when bytes had landed, and takes the next good
plan on a new group.

The plan orders every worker rank's messages by round: with two sources and two worker
ranks, destination 1 hears from source 1 first (round 0) and destination 0 from source 0.
So with both sources sending, the lie is destination 1's first message (nothing written
there) while destination 0 has unpacked source 0's first messages before source 1's lie (or
its breaking off) reaches it.  Trainer rank 0's own sends then break on the dead helper, and
the trainer drops the workers' replies: the replies' codes are checked where rank 0 holds
nothing and sends nothing.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from tests.helpers import TINY, WorkerProcess, free_port, paused_clients, perturbed
from weightsync.core import errors
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.build import make_plan
from weightsync.core.plan.layouts import FleetLayout, Holding, TensorLayout, TrainerLayout, WorkerLayout
from weightsync.core.snapshot import TensorSpec
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer.client import WorkerClient
from weightsync.trainer.sharded import ShardedPusher, ShardedPushFailed
from weightsync.transports.distributed.group import create_group
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.sink import dtype_name

pytestmark = [pytest.mark.hostile, pytest.mark.slow]

TIMEOUT_S = 20.0

LIAR = """
import sys, torch
from tests.hostile.test_plan_size_lie import BASE, held_by, layout_of
from tests.helpers import perturbed
from weightsync.trainer.sharded import ShardedPusher
from weightsync.transports.distributed.group import Group
port, sharding, seed, timeout_s = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
real_send, lied_to = Group.send, set()
def longer(self, tensor, dst, tag):  # 64 bytes more than declared, once per worker rank
    if dst not in lied_to:
        lied_to.add(dst)
        tensor = torch.cat([tensor.reshape(-1), torch.full((64,), 7, dtype=torch.uint8)])
    return real_send(self, tensor, dst, tag)
Group.send = longer
layout = layout_of(sharding)
p = ShardedPusher(1, layout, master_port=port, timeout_s=timeout_s, bucket_bytes=16 << 10).connect()
try:
    p.push(held_by(layout, 1, perturbed(BASE, seed=seed)))
except Exception as exc:
    print("push failed:", exc, file=sys.stderr)
p.close()
print("lied to", sorted(lied_to))
"""

BASE = ReferenceEngine(TINY).model.weights()
SPECS = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in BASE.items()]


def layout_of(sharding: str) -> TrainerLayout:
    """``fsdp``: two ranks, dim-0 shards; ``rank1``: two ranks, rank 1 holding every tensor."""
    if sharding == "fsdp":
        return TrainerLayout.fsdp(SPECS, 2)
    return TrainerLayout(2, tuple(TensorLayout(s, (Holding(Box.full(s.shape), (1,)),)) for s in SPECS))


def held_by(layout: TrainerLayout, rank: int, full: dict) -> dict:
    return {
        n: full[n][tuple(slice(a, b) for a, b in boxes[0].bounds)].contiguous()
        for n, boxes in layout.held_by(rank).items()
    }


def lying_push(clients: list[WorkerClient], sharding: str, seed: int) -> errors.WeightSyncError:
    """Push a plan from two trainer ranks, rank 1 the liar; what the push raised."""
    layout = layout_of(sharding)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LIAR), str(port), sharding, str(seed), str(TIMEOUT_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        p = ShardedPusher(
            0, layout, workers=[c.base_url for c in clients], master_port=port, timeout_s=TIMEOUT_S,
            bucket_bytes=16 << 10,
        ).connect()  # fmt: skip
        try:
            with pytest.raises(errors.WeightSyncError) as caught:
                p.push(held_by(layout, 0, perturbed(BASE, seed=seed)), version="lie")
        finally:
            p.close()
    finally:
        out, err = proc.communicate(timeout=120)
    assert b"lied to" in out, err.decode()[-3000:]
    return caught.value


def good_push(clients: list[WorkerClient], seed: int, version: str) -> None:
    """A good plan on a new group commits on every worker, bit-exact."""
    new = perturbed(BASE, seed=seed)
    with ShardedPusher(
        0, TrainerLayout.whole(SPECS, 1), workers=[c.base_url for c in clients], master_port=free_port(),
        timeout_s=TIMEOUT_S,
    ) as p:  # fmt: skip
        p.push(new, version=version)
    for c in clients:
        state = c.get_weight_version()
        assert state["version"] == version and not state["torn"]
        assert c.engine_rpc("weight_hashes")["result"] == tensor_hashes(new.items())


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    procs = [WorkerProcess(), WorkerProcess()]
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.stop()


def test_more_bytes_than_a_first_piece_declared_is_503_peer_failed_and_changes_nothing(
    workers: list[WorkerProcess],
) -> None:
    w = workers[0]
    with paused_clients([w], version="before") as clients:
        (c,) = clients
        before = c.engine_rpc("weight_hashes")["result"]
        failure = lying_push(clients, "rank1", seed=81)
        assert w.proc.poll() is None, "the worker process died"
        assert isinstance(failure, ShardedPushFailed), failure
        err = failure.failures[c.base_url]
        assert err.code == "peer_failed" and err.http_status == 503, err
        assert "killed by SIGABRT" in err.message, err.message
        state = c.get_weight_version()
        assert state["version"] == "before" and not state["torn"] and state["paused"]
        assert c.engine_rpc("weight_hashes")["result"] == before
        assert c.liveness_probe()["alive"]
        good_push(clients, seed=82, version="after")


def test_two_sources_one_lying_kill_no_worker_and_tear_only_the_worker_that_wrote(
    workers: list[WorkerProcess],
) -> None:
    with paused_clients(workers, version="before") as clients:
        before = [c.engine_rpc("weight_hashes")["result"] for c in clients]
        lying_push(clients, "fsdp", seed=83)
        assert [w.proc.poll() for w in workers] == [None, None], "a worker process died"
        first, second = clients
        # worker 1: the lie was the first message it received; nothing was written
        state = second.get_weight_version()
        assert state["version"] == "before" and not state["torn"] and state["paused"]
        assert second.engine_rpc("weight_hashes")["result"] == before[1]
        # worker 0: source 0's first messages had landed before source 1's lie came
        state = first.get_weight_version()
        assert state["version"] == "before" and state["torn"]
        for c in clients:
            assert c.liveness_probe()["alive"]
        good_push(clients, seed=84, version="after")


def test_a_lying_source_kills_no_tensor_parallel_rank() -> None:
    """The same two sources into a ``--tensor-parallel-size 2`` worker: TP rank 1 (a rank
    process of its own) hears from the liar first.  Every rank lives on: the worker is torn
    (rank 0 wrote), then takes a good plan and generates again."""
    w = WorkerProcess("--tensor-parallel-size", "2")
    try:
        w.wait_ready(120)
        with paused_clients([w], version="before") as clients:
            (c,) = clients
            lying_push(clients, "fsdp", seed=85)
            assert w.proc.poll() is None, "the worker process died"
            state = c.get_weight_version()
            assert state["version"] == "before" and state["torn"]
            assert c.liveness_probe()["alive"]
            good_push(clients, seed=86, version="after")
            c.resume_generation()
            assert c.complete("plan", max_tokens=4)["choices"][0]["token_ids"]
            c.pause_generation()
    finally:
        w.stop()


def test_a_plan_on_a_gloo_group_the_worker_joined_itself_is_refused_before_any_collective(
    workers: list[WorkerProcess],
) -> None:
    """A gloo group joined with receiver ``inline`` carries no plan (a lying source would
    abort the worker): ``400 unsafe_stream``, before the handshake, nothing changed; the
    dry run a fleet's prepare sends is refused the same way."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    part = make_plan(TrainerLayout.whole(SPECS, 1), FleetLayout((WorkerLayout.replica("w", SPECS),))).part(0)
    with paused_clients(workers[:1], version="before") as (c,), ThreadPoolExecutor(1) as pool:
        before = c.engine_rpc("weight_hashes")["result"]
        trainer = pool.submit(
            create_group, "inline", master_address="127.0.0.1", master_port=store.port, rank=0,
            world_size=2, backend="gloo", timeout_s=60, store=store,
        )  # fmt: skip
        c.init_weights_update_group(
            "127.0.0.1", store.port, 1, 2, "inline", backend="gloo", receiver="inline"
        )
        group = trainer.result(timeout=60)
        try:
            for dry_run in (True, False):
                with pytest.raises(errors.InvalidRequest) as caught:
                    c.update_weights_from_plan(
                        "inline", "s", part.to_wire(), weight_version="x", dry_run=dry_run
                    )
                assert caught.value.code == "unsafe_stream" and caught.value.http_status == 400
        finally:
            group.close()
            c.destroy_weights_update_group("inline")
        state = c.get_weight_version()
        assert state["version"] == "before" and not state["torn"]
        assert c.engine_rpc("weight_hashes")["result"] == before
