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


def serve_reference(tmp_path_factory: pytest.TempPathFactory, *args: str) -> Iterator[Served]:
    """A ``weightsync serve`` reference worker on the tiny model (``args`` added to the
    command line), with a checkpoint directory it may read."""
    root = tmp_path_factory.mktemp("reference")
    worker = WorkerProcess("--allowed-weight-dir", str(root), *args).wait_ready(120)
    original: dict[str, torch.Tensor] = CausalLM(ModelConfig.tiny()).weights()
    s = Served(worker, WorkerClient(worker.url), root, original)
    yield s
    s.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve_reference(tmp_path_factory)


class TestDiskOnReference(DiskContract):
    pass


class TestSharedMemoryOnReference(SharedMemoryContract):
    pass


class TestDistributedOnReference(DistributedContract):
    pass


def test_the_reference_worker_serves_the_tiny_model(served: Served, tmp_path: Path) -> None:
    assert {n for n, _, _ in served.specs} == set(served.original)
