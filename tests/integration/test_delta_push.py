"""weightsync's trainer pushes a sparse delta (``Broadcaster.push_delta``) to real ``weightsync
serve`` workers over a gloo group: each checks the manifest's base against what it holds and
verifies the write against the target's claims, exactly as for a delta checkpoint."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.helpers import TINY, WorkerProcess, paused_clients, perturbed, served_workers
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import Broadcaster, PushFailed, WorkerClient, weights_digest
from weightsync.trainer.delta import compute_delta
from weightsync.transports.hashing import tensor_hashes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    with served_workers(2) as procs:
        yield procs


@pytest.fixture
def clients(workers: list[WorkerProcess]) -> Iterator[list[WorkerClient]]:
    with paused_clients(workers) as cs:
        yield cs


def step(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """``weights`` with ``fraction`` of every tensor's elements moved (an RL step's delta)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        flat = t.clone().reshape(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: max(1, int(flat.numel() * fraction))]
        flat[idx] += 0.25
        out[name] = flat.reshape(t.shape)
    return out


def test_a_pushed_delta_brings_every_worker_to_the_targets_digest(clients: list[WorkerClient]) -> None:
    a = perturbed(ReferenceEngine(TINY).model.weights(), seed=21)
    b = step(a, 0.01, seed=22)
    manifest, payload = compute_delta(a, b, base_version="A", target_version="B")
    with Broadcaster([c.base_url for c in clients], timeout_s=30, bucket_bytes=4096) as trainer:
        trainer.push(a, version="A")
        replies = trainer.push_delta(manifest, payload, version="B")
    for c in clients:
        state = c.get_weight_version()
        assert state["version"] == "B" and state["verified"] is True and not state["torn"]
        assert state["digest"] == weights_digest(b) == manifest.target.digest
        assert c.engine_rpc("weight_hashes")["result"] == tensor_hashes(b.items())
    delta = next(iter(replies.values()))["stats"]["delta"]
    checks = delta["checks"]  # every changed tensor checked against the trainer's claims
    assert checks["linear"] + checks["rehash"] == len(manifest.changed) and checks["read_back"] == 0
    assert not delta["rehashed"] and delta["elements_changed"] == sum(t.changed for t in manifest.changed)


def test_a_worker_changed_behind_its_back_refuses_and_the_stream_aborts_for_all(
    clients: list[WorkerClient],
) -> None:
    a = perturbed(ReferenceEngine(TINY).model.weights(), seed=31)
    manifest, payload = compute_delta(a, step(a, 0.01, seed=32), base_version="A", target_version="B")
    with Broadcaster([c.base_url for c in clients], timeout_s=30) as trainer:
        trainer.push(a, version="A")
    with Broadcaster([clients[0].base_url], timeout_s=30) as alone:
        alone.push(step(a, 0.001, seed=33), version="A")  # the same label on other weights
    before = [c.get_weight_version() for c in clients]
    with (
        Broadcaster([c.base_url for c in clients], timeout_s=30) as trainer,
        pytest.raises(PushFailed) as err,
    ):
        trainer.push_delta(manifest, payload, version="B")
    codes = {url: e.code for url, e in err.value.failures.items()}
    assert codes == {clients[0].base_url: "base_mismatch", clients[1].base_url: "stream_aborted"}
    for c, was in zip(clients, before, strict=True):
        now = c.get_weight_version()
        assert now["digest"] == was["digest"] and now["version"] == "A" and not now["torn"]
