"""The channel contracts against the reference engine (``weightsync serve``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.contract.channels import DiskContract, DistributedContract, Served, SharedMemoryContract
from tests.helpers import WorkerProcess
from weightsync.engines.reference import CausalLM, ModelConfig
from weightsync.trainer import WorkerClient


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("reference")
    worker = WorkerProcess("--allowed-weight-dir", str(root)).wait_ready()
    original: dict[str, torch.Tensor] = CausalLM(ModelConfig.tiny()).weights()
    s = Served(worker, WorkerClient(worker.url), root, original)
    yield s
    s.close()


class TestDiskOnReference(DiskContract):
    pass


class TestSharedMemoryOnReference(SharedMemoryContract):
    pass


class TestDistributedOnReference(DistributedContract):
    pass


def test_the_reference_worker_serves_the_tiny_model(served: Served, tmp_path: Path) -> None:
    assert {n for n, _, _ in served.specs} == set(served.original)
