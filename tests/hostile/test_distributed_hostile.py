"""A lying trainer over real gloo groups, against a real ``weightsync serve`` worker process:
the worker survives, answers, and never commits a version for bytes it did not verify."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers import TINY, WorkerProcess, free_port, paused_clients, perturbed, served_workers
from weightsync.core import Controller, errors
from weightsync.engines.reference import ReferenceEngine
from weightsync.engines.reference import runner as runner_mod
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import AsyncWorkerClient, Broadcaster, PushFailed, WorkerClient
from weightsync.trainer import broadcast as trainer_mod
from weightsync.transports.distributed import group as group_mod
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.sink import TensorSink

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with served_workers(1) as [proc]:
        yield proc


@pytest.fixture
def client(worker: WorkerProcess) -> Iterator[WorkerClient]:
    with paused_clients([worker], version="before") as [c]:
        yield c


def trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    return perturbed(ReferenceEngine(TINY).model.weights(), seed=seed)


def _alive_and_uncommitted(worker: WorkerProcess, client: WorkerClient) -> dict[str, Any]:
    assert worker.proc.poll() is None, f"worker died with {worker.proc.returncode}"
    assert client.liveness_probe()["alive"]
    state = client.get_weight_version()
    assert state["version"] == "before"
    return state


def test_a_trainer_that_sends_more_bytes_than_it_declared_is_refused_before_any_collective(
    worker: WorkerProcess, client: WorkerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    honest = trainer_weights(seed=31)
    lying = dict(honest)
    lying["model.norm.weight"] = torch.cat([honest["model.norm.weight"]] * 4)  # 4x the declared bytes
    declared_shape = list(honest["model.norm.weight"].shape)
    post = AsyncWorkerClient.update_weights_from_distributed

    async def declare_the_honest_shape(
        self: Any, names: list[str], dtypes: Any, shapes: Any, *a: Any, **k: Any
    ) -> Any:
        shapes = [
            declared_shape if n == "model.norm.weight" else s for n, s in zip(names, shapes, strict=True)
        ]
        return await post(self, names, dtypes, shapes, *a, **k)

    before = client.engine_rpc("weight_hashes")["result"]
    with Broadcaster([worker.url], timeout_s=10) as b:
        with monkeypatch.context() as m:  # the lie: skip the trainer's own check, declare other shapes
            m.setattr(trainer_mod, "check_metadata", lambda *a, **k: [])
            m.setattr(AsyncWorkerClient, "update_weights_from_distributed", declare_the_honest_shape)
            with pytest.raises(PushFailed) as err:
                b.push(lying, version="lie")
        assert {e.code for e in err.value.failures.values()} == {"stream_mismatch"}
        state = _alive_and_uncommitted(worker, client)
        assert not state["torn"]
        assert client.engine_rpc("weight_hashes")["result"] == before
        b.push(honest, version="honest")  # the group is still in step
    assert client.get_weight_version()["version"] == "honest"
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(honest.items())


def test_a_trainer_that_sends_fewer_bytes_tears_the_worker_instead_of_committing(
    worker: WorkerProcess, client: WorkerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    broadcast = group_mod.Group.broadcast

    def short_broadcast(self: group_mod.Group, tensor: torch.Tensor) -> Any:
        if tensor.dtype == torch.uint8 and tensor.numel() > 128:  # a bucket: leave off its tail
            tensor = tensor[:-64]
        return broadcast(self, tensor)

    with Broadcaster([worker.url], timeout_s=10) as b:
        with monkeypatch.context() as m:
            m.setattr(group_mod.Group, "broadcast", short_broadcast)
            with pytest.raises(PushFailed) as err:
                b.push(trainer_weights(seed=32), version="short")
        (failure,) = err.value.failures.values()
        assert failure.code == "weights_torn" and "checksum" in failure.message
        state = _alive_and_uncommitted(worker, client)
        assert state["torn"] and state["paused"]
        healed = trainer_weights(seed=33)
        b.push(healed, version="healed")  # the stream stayed in step: the same group heals it
    state = client.get_weight_version()
    assert state["version"] == "healed" and not state["torn"]
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(healed.items())


def test_received_tensors_are_hashed_into_the_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    sinks: list[TensorSink] = []

    class Recording(TensorSink):
        def __init__(self, targets: Any) -> None:
            super().__init__(targets)
            sinks.append(self)

    monkeypatch.setattr(runner_mod, "TensorSink", Recording)
    engine = ReferenceEngine(TINY)
    new = trainer_weights(seed=34)
    with ServerThread(create_app(Controller(engine))) as server:
        with WorkerClient(server.url) as c:
            c.pause_generation()
        # 16 KiB buckets: the 64 KiB embedding travels alone, straight into the engine's tensor
        with Broadcaster([server.url], timeout_s=10, bucket_bytes=16 << 10) as b:
            b.push(new, version="hashed")
    assert sinks[-1].hashes == tensor_hashes(new.items())


def test_rendezvous_gives_up_within_timeout_s(client: WorkerClient) -> None:
    timeout_s = 3.0
    # One deadline for the store connection and the rendezvous together: a join that spent
    # timeout_s on each would take twice as long; the slack above one is the HTTP round trip
    # on a loaded machine (0.7 s seen on two busy cores), not a second wait.
    bound = timeout_s * 1.5
    # nobody listens at the address
    t0 = time.monotonic()
    with pytest.raises(errors.EngineUnavailable):
        client.init_weights_update_group(
            "127.0.0.1", free_port(), 1, 2, "nobody", backend="gloo", timeout_s=timeout_s
        )
    assert time.monotonic() - t0 < bound
    # a store listens, but rank 0 never joins
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    t0 = time.monotonic()
    with pytest.raises(errors.EngineUnavailable):
        client.init_weights_update_group(
            "127.0.0.1", store.port, 1, 2, "alone", backend="gloo", timeout_s=timeout_s
        )
    assert time.monotonic() - t0 < bound
    assert client.liveness_probe()["alive"]


@pytest.mark.parametrize("timeout_s", [1e300, 1e9])
def test_an_absurd_timeout_is_a_400(client: WorkerClient, timeout_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    t0 = time.monotonic()
    with pytest.raises(errors.InvalidRequest) as err:
        client.init_weights_update_group(
            "127.0.0.1", store.port, 1, 2, "forever", backend="gloo", timeout_s=timeout_s
        )
    assert err.value.code == "invalid_value" and time.monotonic() - t0 < 2
    with pytest.raises(errors.NotFound):
        client.destroy_weights_update_group("forever")
