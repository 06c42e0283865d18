"""Sharded plans into a real vLLM worker: two trainer ranks (this process is rank 0, rank 1
a subprocess) holding FSDP dim-0 shards of a tiny Llama push into `weightsync serve --engine
vllm` over gloo; the worker receives every tensor's pieces and hands it to vLLM's reload
once complete (weightsync.transports.plan.pull).

The fleet is this one vLLM worker: a reference worker cannot join it, as it serves its own
model's tensors, not a Llama's.  The worker starts on checkpoint ``b`` (what a fresh vLLM
answers there is recorded), then loads ``a`` from disk.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port
from tests.vllm.servers import held, vllm_worker
from tests.vllm.tiny_llama import TinyLlamas
from weightsync.core.plan.layouts import TrainerLayout
from weightsync.engines.vllm.checkpoint import served_specs
from weightsync.trainer import WorkerClient
from weightsync.trainer.sharded import ShardedPusher, ShardedPushFailed
from weightsync.transports.hashing import tensor_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 2, 3, 4, 5], list(range(40, 80))]
BUCKET = 64 << 10  # half of a large tensor is sent alone, the small ones packed

RANK1 = """
import sys
from safetensors.torch import load_file
from weightsync.core.plan.layouts import TrainerLayout
from weightsync.engines.vllm.checkpoint import served_specs
from weightsync.trainer.sharded import ShardedPusher
model, port, lie, bucket = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
layout = TrainerLayout.fsdp(list(served_specs(model).values()), 2)
full = load_file(model + "/model.safetensors")
held = {n: full[n][tuple(slice(a, b) for a, b in boxes[0].bounds)].contiguous()
        for n, boxes in layout.held_by(1).items()}
if lie == "checksum":  # this rank posts a wrong hash for every piece it sent (records: index, position, hash)
    import weightsync.trainer.sharded_step as ts
    real_send = ts.send
    def lying(*args):
        sums = real_send(*args)
        return bytes(b ^ 0xFF if i % 24 >= 16 else b for i, b in enumerate(sums))
    ts.send = lying
with ShardedPusher(1, layout, master_port=port, timeout_s=60, bucket_bytes=bucket) as p:
    p.push(held)
"""


def greedy(client: WorkerClient) -> list[list[int]]:
    return [client.complete(p, max_tokens=16)["choices"][0]["token_ids"] for p in PROMPTS]


class Setup:
    def __init__(self, models: TinyLlamas) -> None:
        self.models = models
        self.worker = vllm_worker(models.b, models.root)
        try:
            self.client = WorkerClient(self.worker.url)
            self.fresh_b_outputs = greedy(self.client)
            self.client.pause_generation("wait")
            self.client.update_weights_from_disk(str(models.a), weight_version="a")
            self.client.resume_generation()
            self.a_outputs = greedy(self.client)
        except BaseException:
            self.worker.stop()
            raise


@pytest.fixture(scope="module")
def setup(tiny_llamas: TinyLlamas) -> Iterator[Setup]:
    with held(Setup(tiny_llamas)) as s:
        yield s


@pytest.fixture
def client(setup: Setup) -> WorkerClient:
    """The worker, paused (each test starts from a paused worker, torn or not)."""
    c = setup.client
    if not c.get_weight_version()["paused"]:
        c.pause_generation("wait")
    return c


def push(client: WorkerClient, model: Path, version: str, lie: str = "-") -> dict[str, Any]:
    """Push ``model``'s weights by a plan from two FSDP ranks; rank 0's reply by URL."""
    from safetensors.torch import load_file

    layout = TrainerLayout.fsdp(list(served_specs(str(model)).values()), 2)
    full = load_file(str(model / "model.safetensors"))
    held = {
        n: full[n][tuple(slice(a, b) for a, b in boxes[0].bounds)].contiguous()
        for n, boxes in layout.held_by(0).items()
    }
    port = free_port()
    rank1 = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(RANK1), str(model), str(port), lie, str(BUCKET)],
        stderr=subprocess.PIPE,
    )
    try:
        with ShardedPusher(
            0, layout, workers=[client.base_url], master_port=port, timeout_s=60, bucket_bytes=BUCKET
        ) as p:
            assert {t.src for t in p.plan.part(0).transfers} == {0, 1}  # both ranks send to it
            return p.push(held, version=version)
    finally:
        _, err = rank1.communicate(timeout=120)
        assert rank1.returncode == 0, err.decode()


def test_two_fsdp_ranks_push_a_plan_that_vllm_serves_as_a_fresh_vllm_on_disk(
    setup: Setup, client: WorkerClient
) -> None:
    assert setup.a_outputs != setup.fresh_b_outputs  # the update is visible in the outputs
    replies = push(client, setup.models.b, "plan-b")
    assert replies[client.base_url]["version"] == "plan-b"
    assert replies[client.base_url]["stats"]["tensors"] == len(setup.models.b_tensors)
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(setup.models.b_tensors.items())
    state = client.get_weight_version()
    assert state["version"] == "plan-b" and not state["torn"]
    client.resume_generation()
    assert greedy(client) == setup.fresh_b_outputs


def test_a_lying_source_tears_and_the_next_honest_push_commits(setup: Setup, client: WorkerClient) -> None:
    before = client.get_weight_version()
    with pytest.raises(ShardedPushFailed) as exc:
        push(client, setup.models.a, "plan-a-lie", lie="checksum")
    (failure,) = exc.value.failures.values()
    assert failure.code == "weights_torn"
    assert "differ from what the trainer sent" in failure.message  # the pieces' checksums
    state = client.get_weight_version()
    assert state["version"] == before["version"]  # never committed
    assert state["torn"]  # vLLM took tensors that cannot be vouched for
    assert client.liveness_probe()["alive"]
    replies = push(client, setup.models.a, "plan-a")
    assert replies[client.base_url]["version"] == "plan-a"
    state = client.get_weight_version()
    assert state["version"] == "plan-a" and not state["torn"]
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(setup.models.a_tensors.items())
    client.resume_generation()
    assert greedy(client) == setup.a_outputs
