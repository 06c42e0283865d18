"""The channel contracts against the vLLM engine (one ``weightsync serve --engine vllm`` per
module: each start costs ~40-60 s and ~7 GB)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from safetensors.torch import load_file

from tests.contract.channels import DiskContract, DistributedContract, Served, SharedMemoryContract
from tests.vllm.servers import vllm_worker
from weightsync.trainer import WorkerClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from tests.vllm.tiny_llama import make_tiny_llama

    root = tmp_path_factory.mktemp("vllm-contract")
    model = make_tiny_llama(root / "served", seed=1)
    worker = vllm_worker(model, root)
    s = Served(worker, WorkerClient(worker.url), root, load_file(str(model / "model.safetensors")))
    yield s
    s.close()


class TestDiskOnVllm(DiskContract):
    pass


class TestSharedMemoryOnVllm(SharedMemoryContract):
    pass


class TestDistributedOnVllm(DistributedContract):
    pass
