"""The channel contracts against a tensor-parallel reference engine
(``weightsync serve --tensor-parallel-size 2``): every channel loads, refuses, dry-runs and
tears exactly as on one process, and reports the digest of the full logical tensors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.contract.channels import DiskContract, DistributedContract, Served, SharedMemoryContract
from tests.helpers import WorkerProcess
from weightsync.engines.reference import CausalLM, ModelConfig
from weightsync.trainer import WorkerClient

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("reference-tp")
    worker = WorkerProcess("--allowed-weight-dir", str(root), "--tensor-parallel-size", "2").wait_ready(120)
    original: dict[str, torch.Tensor] = CausalLM(ModelConfig.tiny()).weights()
    s = Served(worker, WorkerClient(worker.url), root, original)
    yield s
    s.close()


class TestDiskOnTensorParallelReference(DiskContract):
    pass


class TestSharedMemoryOnTensorParallelReference(SharedMemoryContract):
    pass


class TestDistributedOnTensorParallelReference(DistributedContract):
    pass


def test_the_tensor_parallel_worker_reports_two_ranks_and_full_shapes(served: Served) -> None:
    assert served.client.routes()["world_size"] == 2
    assert {n: list(t.shape) for n, t in served.original.items()} == {n: s for n, _, s in served.specs}
    layout = served.client.engine_rpc("tp_layout")["result"]
    assert len(layout) == 2
    assert layout[1]["model.layers.0.self_attn.q_proj.weight"] == [0, 32, 32]
    assert layout[0]["model.norm.weight"] == "full"
