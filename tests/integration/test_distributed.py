"""Distributed transport with real processes: `weightsync serve` workers, gloo groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import TINY, WorkerProcess, free_port, paused_clients, perturbed, run, served_workers
from weightsync.core import Controller, errors
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import Broadcaster, PushFailed, WorkerClient
from weightsync.transports.hashing import tensor_hashes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    with served_workers(2) as procs:
        yield procs


@pytest.fixture
def clients(workers: list[WorkerProcess]) -> Iterator[list[WorkerClient]]:
    with paused_clients(workers) as cs:  # each test starts from a healthy, paused worker
        yield cs


def trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    return perturbed(ReferenceEngine(TINY).model.weights(), seed=seed)


def test_push_makes_every_worker_bit_identical_to_the_trainer(clients: list[WorkerClient]) -> None:
    new = trainer_weights(seed=11)
    with Broadcaster([c.base_url for c in clients], timeout_s=20, bucket_bytes=64 << 10) as b:
        replies = b.push(new, version="step-1")
    assert all(r["version"] == "step-1" and r["prefix_cache_reset"] for r in replies.values())
    expected = tensor_hashes(new.items())
    for c in clients:
        assert c.engine_rpc("weight_hashes")["result"] == expected
        assert c.get_weight_version()["version"] == "step-1"

    # greedy outputs equal those of a fresh engine built from the same weights
    async def fresh_output() -> list[int]:
        engine = ReferenceEngine(TINY)
        for name, t in engine.model.weights().items():
            t.copy_(new[name])
        out = await engine.generate(list(b"distributed"), max_tokens=16)
        await engine.close()
        return out.token_ids

    want = run(fresh_output())
    for c in clients:
        c.resume_generation()
        assert c.complete("distributed", max_tokens=16)["choices"][0]["token_ids"] == want
        c.pause_generation()


def test_mismatched_metadata_is_refused_before_any_byte_moves(clients: list[WorkerClient]) -> None:
    before = [c.engine_rpc("weight_hashes")["result"] for c in clients]
    bad = trainer_weights(seed=12)
    bad["model.norm.weight"] = torch.ones(3)
    with Broadcaster([c.base_url for c in clients], timeout_s=20) as b:
        with pytest.raises(errors.InvalidRequest) as err:  # the trainer learns it before broadcasting
            b.push(bad, version="bad")
        assert err.value.code == "shape_mismatch"
        # and a worker refuses the same metadata itself, at once, without entering a collective
        t0 = time.monotonic()
        with pytest.raises(errors.InvalidRequest) as err:
            clients[0].update_weights_from_distributed(
                ["model.norm.weight"], ["float32"], [[3]], "weightsync",
                packing={"bucket_bytes": 1024, "stream_id": "x"},
            )  # fmt: skip
        assert err.value.code == "shape_mismatch" and time.monotonic() - t0 < 5
        good = trainer_weights(seed=13)
        b.push(good, version="after")  # the group is still in step
    assert [c.engine_rpc("weight_hashes")["result"] for c in clients] != before
    assert clients[0].engine_rpc("weight_hashes")["result"] == tensor_hashes(good.items())


def test_a_refusing_worker_aborts_the_stream_for_all_without_tearing(clients: list[WorkerClient]) -> None:
    clients[0].resume_generation()  # running without allow_unpaused: it will refuse
    before = clients[1].engine_rpc("weight_hashes")["result"]
    with Broadcaster([c.base_url for c in clients], timeout_s=20) as b:
        with pytest.raises(PushFailed) as err:
            b.push(trainer_weights(seed=14), version="refused")
        codes = {url: e.code for url, e in err.value.failures.items()}
        assert codes == {clients[0].base_url: "not_paused", clients[1].base_url: "stream_aborted"}
        assert clients[1].engine_rpc("weight_hashes")["result"] == before
        assert not clients[1].get_weight_version()["torn"]
        clients[0].pause_generation()
        b.push(trainer_weights(seed=15), version="accepted")
    assert {c.get_weight_version()["version"] for c in clients} == {"accepted"}


TRAINER_SCRIPT = """
import sys, time, torch
from weightsync.transports.distributed import group as group_mod
from weightsync.trainer import Broadcaster
from weightsync.engines.reference import ReferenceEngine, ModelConfig
urls = sys.argv[1].split(",")
weights = ReferenceEngine(ModelConfig.tiny()).model.weights()
weights = {n: t + 1 for n, t in weights.items()}
broadcast = group_mod.Group.broadcast
sent = 0
def slow_broadcast(self, tensor):
    global sent
    sent += 1
    if sent == 2:
        print("MID-STREAM", flush=True)
    time.sleep(0.5)
    return broadcast(self, tensor)
group_mod.Group.broadcast = slow_broadcast
b = Broadcaster(urls, timeout_s=float(sys.argv[2]), bucket_bytes=16 << 10).connect()
b.push(weights, version="never")
"""


def test_killed_trainer_leaves_workers_torn_alive_and_healable(
    clients: list[WorkerClient], tmp_path: Path
) -> None:
    timeout_s = 5.0
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER_SCRIPT))
    proc = subprocess.Popen(
        [sys.executable, str(script), ",".join(c.base_url for c in clients), str(timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert "MID-STREAM" in line, proc.stderr.read().decode() if proc.stderr else ""
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    killed = time.monotonic()
    for c in clients:
        while not c.get_weight_version()["torn"]:
            assert time.monotonic() - killed < timeout_s + 5, "worker not torn within timeout_s"
            time.sleep(0.05)
        state = c.get_weight_version()
        assert state["paused"] and state["version"] != "never"
        assert c.liveness_probe()["alive"]
        with pytest.raises(errors.IllegalState):
            c.resume_generation()
    healed = trainer_weights(seed=16)
    with Broadcaster(
        [c.base_url for c in clients], timeout_s=20
    ) as b:  # same group name: the broken one was dropped
        b.push(healed, version="healed")
    for c in clients:
        state = c.get_weight_version()
        assert state["version"] == "healed" and not state["torn"]
        assert c.engine_rpc("weight_hashes")["result"] == tensor_hashes(healed.items())
        c.resume_generation()
        c.pause_generation()


def test_rendezvous_nobody_joins_fails_within_timeout(clients: list[WorkerClient]) -> None:
    t0 = time.monotonic()
    with pytest.raises(errors.EngineUnavailable) as err:
        clients[0].init_weights_update_group(
            "127.0.0.1", free_port(), 1, 2, "lonely", backend="gloo", timeout_s=2
        )
    assert err.value.code == "rendezvous_failed"
    assert time.monotonic() - t0 < 2 + 5
    assert clients[0].liveness_probe()["alive"]
    with pytest.raises(errors.NotFound):
        clients[0].destroy_weights_update_group("lonely")


def test_concurrent_pushes_are_serialised(clients: list[WorkerClient]) -> None:
    versions = []
    with Broadcaster([c.base_url for c in clients], timeout_s=20, bucket_bytes=32 << 10) as b:
        pushes = [threading.Thread(target=lambda i=i: versions.append(b.push(trainer_weights(20 + i), version=f"p{i}")))
                  for i in range(2)]  # fmt: skip
        for t in pushes:
            t.start()
        for t in pushes:
            t.join()
        assert len(versions) == 2
        final = clients[0].get_weight_version()["version"]
        last = trainer_weights(20 + int(final[1:]))
        for c in clients:
            assert c.engine_rpc("weight_hashes")["result"] == tensor_hashes(last.items())


def test_unpaused_push_streams_while_a_completion_runs(workers: list[WorkerProcess]) -> None:
    worker = WorkerProcess(model_config="default").wait_ready()
    try:
        client = WorkerClient(worker.url)
        client.set_weight_version("before")
        weights = perturbed(ReferenceEngine().model.weights(), seed=3)
        result: dict[str, object] = {}
        with Broadcaster([worker.url], timeout_s=30) as b:
            job = threading.Thread(target=lambda: result.update(client.complete("async", max_tokens=400)))
            job.start()
            time.sleep(0.5)
            assert job.is_alive()
            reply = b.push(weights, version="during", allow_unpaused=True)
        assert reply[worker.url]["prefix_cache_reset"] is False
        job.join(60)
        spans = result["weight_version_spans"]
        assert [s["version"] for s in spans] == ["before", "during"]  # type: ignore[index]
        client.close()
    finally:
        worker.stop()


def test_init_destroy_cycles_leak_no_threads_sockets_or_ports() -> None:
    engine = ReferenceEngine(TINY)
    with ServerThread(create_app(Controller(engine))) as server:

        def counts() -> tuple[int, int]:
            return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))

        def cycle() -> None:
            b = Broadcaster([server.url], timeout_s=10).connect()
            b.close()

        cycle()  # warm up lazily created pools
        before = counts()
        for _ in range(20):
            cycle()
        time.sleep(0.5)
        after = counts()
        assert after[0] <= before[0] + 2, f"threads {before[0]} -> {after[0]}"
        assert after[1] <= before[1] + 2, f"fds {before[1]} -> {after[1]}"
        assert httpx.get(f"{server.url}/health").json()["alive"]
