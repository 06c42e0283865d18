"""A sharded plan into `weightsync serve --tensor-parallel-size 2`: trainer ranks (this
process is rank 0, the others subprocesses) push into a fleet of a TP=2 worker (two rank
processes, each a member of the group) and a TP=1 worker.  Every rank receives only its
own shard pieces; the TP worker ends bit-exact, with the greedy output and the digest of
the TP=1 worker; a lying or dying source is never committed on any rank."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import WorkerProcess, free_port, perturbed
from tests.integration.test_sharded import BASE, SPECS, fresh_output, held_by, others
from weightsync.core import errors
from weightsync.core.plan.layouts import TrainerLayout
from weightsync.core.plan.value import max_sender_share
from weightsync.trainer.client import WorkerClient
from weightsync.trainer.sharded import ShardedPusher, ShardedPushFailed
from weightsync.transports.hashing import tensor_hashes

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[WorkerProcess]]:
    procs = [WorkerProcess("--tensor-parallel-size", "2"), WorkerProcess()]
    try:
        yield [p.wait_ready(120) for p in procs]
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def clients(fleet: list[WorkerProcess]) -> Iterator[list[WorkerClient]]:
    cs = [WorkerClient(w.url) for w in fleet]
    for c in cs:
        state = c.get_weight_version()
        if not state["paused"]:
            c.pause_generation("abort")
    yield cs
    for c in cs:
        c.close()


def pusher(
    clients: list[WorkerClient], layout: TrainerLayout, port: int, timeout_s: float = 40
) -> ShardedPusher:
    return ShardedPusher(
        0, layout, workers=[c.base_url for c in clients], master_port=port, timeout_s=timeout_s,
        bucket_bytes=16 << 10,
    ).connect()  # fmt: skip


@pytest.mark.parametrize(("sharding", "ranks"), [("fsdp", 2), ("tp", 2)])
def test_trainer_shards_into_a_tp2_worker_match_a_tp1_worker(
    clients: list[WorkerClient], sharding: str, ranks: int
) -> None:
    layout = getattr(TrainerLayout, sharding)(SPECS, ranks)
    port = free_port()
    procs = others(ranks, sharding, port, [61])
    new = perturbed(BASE, seed=61)
    try:
        p = pusher(clients, layout, port)
        plan = p.plan
        assert [w.world_size for w in plan.fleet.workers] == [2, 1]  # the TP worker's own layout
        assert max_sender_share(plan) <= 1.1 / ranks
        replies = p.push(held_by(layout, 0, new), version=f"tp-{sharding}")
        p.close()
    finally:
        for proc in procs:
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err.decode()
    tp2 = clients[0]
    reply = replies[tp2.base_url]
    assert reply["version"] == f"tp-{sharding}"
    received = reply["stats"]["received_bytes"]
    for r, got in enumerate(received):  # each rank received only what it serves (+ alignment)
        want = sum(t.size for t in plan.transfers if (t.worker, t.rank) == (0, r))
        assert got == want
        assert want < plan.needed_bytes(0, r) * 1.02
    assert plan.needed_bytes(0, 1) < plan.needed_bytes(1, 0)  # a TP rank needs less than a replica
    expected = tensor_hashes(new.items())
    digests = [c.get_weight_version()["digest"] for c in clients]
    assert digests[0] == digests[1]  # the TP=2 worker attests what the TP=1 worker does
    want = fresh_output(new)
    for c in clients:
        assert c.engine_rpc("weight_hashes")["result"] == expected  # bit-exact on every rank
        c.resume_generation()
        assert c.complete("sharded", max_tokens=12)["choices"][0]["token_ids"] == want
        c.pause_generation()


@pytest.mark.parametrize("lie", ["checksum", "die", "short"])
def test_a_lying_or_dying_source_commits_on_no_rank(clients: list[WorkerClient], lie: str) -> None:
    layout = TrainerLayout.fsdp(SPECS, 2)
    port = free_port()
    before = [c.get_weight_version() for c in clients]
    procs = others(2, "fsdp", port, [71], lie)
    try:
        # a sender whose peer dropped the group waits out the group's timeout: keep it short
        p = pusher(clients, layout, port, timeout_s=15 if lie == "die" else 40)
        with pytest.raises((ShardedPushFailed, errors.WeightSyncError)) as exc:
            p.push(held_by(layout, 0, perturbed(BASE, seed=71)), version="lie")
        p.close()
    finally:
        for proc in procs:
            proc.communicate(timeout=90)
    tp2 = clients[0]
    for c, old in zip(clients, before, strict=True):
        state = c.get_weight_version()
        assert state["version"] == old["version"]  # never committed
        assert c.liveness_probe()["alive"]  # never a dead worker, on any rank
        if lie == "short":  # refused before any rank wrote
            assert state["torn"] == old["torn"] and state["digest"] == old["digest"]
        else:
            assert state["torn"]  # bytes moved on its ranks and cannot be vouched for
    if lie == "short":
        assert isinstance(exc.value, ShardedPushFailed)
        assert exc.value.failures[tp2.base_url].code == "stream_mismatch"
    elif isinstance(exc.value, ShardedPushFailed) and tp2.base_url in exc.value.failures:
        assert exc.value.failures[tp2.base_url].code in {
            "checksum_mismatch",
            "stream_failed",
            "stream_aborted",
            "weights_torn",
        }
    # the worker recovers with a good plan on a new group, on every rank
    good = perturbed(BASE, seed=72)
    layout1 = TrainerLayout.whole(SPECS, 1)
    p = pusher(clients, layout1, free_port())
    try:
        p.push(good, version="recovered")
    finally:
        p.close()
    for c in clients:
        state = c.get_weight_version()
        assert state["version"] == "recovered" and not state["torn"]
        assert c.engine_rpc("weight_hashes")["result"] == tensor_hashes(good.items())
