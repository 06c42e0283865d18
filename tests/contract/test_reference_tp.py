"""The channel contracts against a tensor-parallel reference engine
(``weightsync serve --tensor-parallel-size 2``): every channel loads, refuses, dry-runs and
tears exactly as on one process, and reports the digest of the full logical tensors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.contract.channels import DiskContract, DistributedContract, Served, SharedMemoryContract
from tests.contract.test_reference import serve_reference

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve_reference(tmp_path_factory, "--tensor-parallel-size", "2")


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
    from weightsync.core.plan.layouts import WorkerLayout

    wl = WorkerLayout.from_wire(served.client.engine_rpc("worker_layout")["result"])
    assert wl.world_size == 2  # what a sharded plan targets: the same split, as boxes
    assert wl.served(1)["model.layers.0.self_attn.q_proj.weight"].bounds == ((32, 64), (0, 64))
    assert wl.served(0)["model.norm.weight"].bounds == ((0, 64),)
