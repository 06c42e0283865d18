"""``verify_weights`` with ``allow_load_digest`` after a load over a process group: the
distributed channel copies every tensor into the served memory and hashes it there, after
the write (a bucket's slice or a helper's broadcast in one pass; a lone tensor received
straight into the engine's own and hashed there once in), so the digest the load took stands
for a re-hash (scope ``load_in_place``), as after a disk load, and equals the digest of what
the trainer sent.  Through a real loopback worker: weightsync's packed stream from its own
trainer (buckets and lone tensors both), and SGLang's trainer's bare per-tensor and
``flattened_bucket`` streams through a helper process.  A re-hash of the served weights
agrees each time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch.distributed as dist

from tests.helpers import TINY, paused_clients, perturbed, served_workers
from tests.peers.sglang_worker import SglangWorker, sglang_worker
from tests.peers.test_sglang_update_weights_from_distributed import (
    GROUP,
    sglang_trainer_group,
    update_and_broadcast,
)
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import Broadcaster, WorkerClient, weights_digest

__all__ = ["sglang_worker"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client() -> Iterator[WorkerClient]:
    with served_workers(1) as procs, paused_clients(procs) as clients:
        yield clients[0]


def test_a_packed_push_is_attested_by_the_digest_it_took_in_place(client: WorkerClient) -> None:
    new = perturbed(ReferenceEngine(TINY).model.weights(), seed=21)
    with Broadcaster([client.base_url], timeout_s=30, bucket_bytes=64 << 10) as b:  # lone and bucketed
        b.push(new, version="p-1")
    loaded = client.verify_weights(allow_load_digest=True)
    assert (loaded["scope"], loaded["match"], loaded["digest"]) == (
        "load_in_place",
        True,
        weights_digest(new),
    )
    again = client.verify_weights()
    assert (again["scope"], again["digest"]) == ("live_weights", loaded["digest"])


def _verify(worker: SglangWorker, **body: Any) -> dict[str, Any]:
    r = requests.post(f"{worker.url}/engine/verify_weights", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened-bucket"])
def test_an_sglang_stream_through_a_helper_is_attested_in_place(
    sglang_worker: SglangWorker, flattened: bool
) -> None:
    launched = _verify(sglang_worker, allow_load_digest=True)
    base = perturbed({k: v.clone() for k, v in sglang_worker.engine.model.weights().items()}, seed=23)
    group = sglang_trainer_group(sglang_worker, int)
    try:
        reply = update_and_broadcast(sglang_worker, base, group, flattened=flattened, weight_version="s-1")
        assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
        sglang_worker.post("/destroy_weights_update_group", {"group_name": GROUP})
    finally:
        dist.destroy_process_group(group)
    loaded = _verify(sglang_worker, allow_load_digest=True)
    assert (loaded["scope"], loaded["match"], loaded["digest"]) == (
        "load_in_place",
        True,
        weights_digest(base),
    )
    assert loaded["digest"] != launched["digest"]
    assert _verify(sglang_worker)["digest"] == loaded["digest"]
