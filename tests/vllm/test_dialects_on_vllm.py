"""The dialects on a real vLLM engine (``weightsync serve --engine vllm``): vLLM's own
``HTTPVLLMWeightSyncClient`` and trainer flow, and SGLang's routes, drive one shared worker.

One engine serves every test of this module.  What the new weights should answer is what the
same engine answers after a disk load of the same checkpoint (a channel that
``test_vllm.py`` checks against a fresh vLLM), and the old weights must answer exactly as the
engine did at start.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import torch.distributed as dist

from tests.helpers import free_port
from tests.peers.sglang_calls import init_custom_process_group
from tests.peers.torch_trainer import PlainTrainer
from tests.vllm.servers import held, vllm_worker
from tests.vllm.test_vllm import greedy
from tests.vllm.tiny_llama import TinyLlamas
from weightsync.core.held import weights_digest
from weightsync.trainer import WorkerClient
from weightsync.transports.distributed.group import Group, create_group
from weightsync.transports.hashing import tensor_hash, tensor_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]


class Served:
    def __init__(self, models: TinyLlamas) -> None:
        self.root, self.a, self.b = models.root, models.a, models.b
        self.a_tensors, self.b_tensors = models.a_tensors, models.b_tensors
        self.worker = vllm_worker(self.a, self.root)
        try:
            self.start()
        except BaseException:
            self.worker.stop()
            raise

    def start(self) -> None:
        self.url = self.worker.url
        self.client = WorkerClient(self.url)
        self.a_outputs = greedy(self.client)
        self.client.pause_generation("wait")
        self.client.update_weights_from_disk(str(self.b), weight_version="b-disk")
        self.client.resume_generation()
        self.b_outputs = greedy(self.client)  # b, loaded from disk by the same engine
        self.load_a()
        assert greedy(self.client) == self.a_outputs

    def load_a(self) -> None:
        self.client.pause_generation("wait")
        self.client.update_weights_from_disk(str(self.a), weight_version="a")
        self.client.resume_generation()

    def state(self) -> dict[str, Any]:
        return self.client.get_weight_version()


@pytest.fixture(scope="module")
def served(tiny_llamas: TinyLlamas) -> Iterator[Served]:
    with held(Served(tiny_llamas)) as s:
        yield s


@pytest.fixture
def worker(served: Served) -> Iterator[Served]:
    """The shared worker serving ``a``, running; put back there afterwards."""
    state = served.state()
    if state["torn"] or state["paused"] or state["version"] != "a":
        served.load_a()
    yield served
    requests.post(f"{served.url}/shutdown_weight_transfer_engine", timeout=60)
    state = served.state()
    if state["session_open"]:
        served.client.http.post("/engine/abort_weight_update", json={})
    if state["torn"] or state["version"] != "a" or state["paused"]:
        served.load_a()


def trainer_group(port: int, name: str) -> Any:
    """A TCPStore at ``port`` and rank 0 of a gloo group of two, joining in a thread; on the
    vLLM dialect's group, a plain ``init_process_group`` trainer (``tests/peers/torch_trainer.py``)."""
    if name == "vllm":
        return None, PlainTrainer(port=port).ready()
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, datetime.timedelta(seconds=300), wait_for_workers=False
    )
    pool = ThreadPoolExecutor(1)
    joined = pool.submit(
        create_group, name, master_address="127.0.0.1", master_port=port, rank=0,
        world_size=2, backend="gloo", timeout_s=300, store=store,
    )  # fmt: skip
    return store, joined


def init_info(port: int, **extra: Any) -> dict[str, Any]:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "timeout_s": 300, **extra}  # fmt: skip


def stock_update_info(tensors: dict[str, torch.Tensor], **extra: Any) -> dict[str, Any]:
    """vLLM's stock ``nccl`` backend's ``update_info`` for ``tensors``."""
    return {
        "names": list(tensors),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        **extra,
    }


def packed_chunks(tensors: dict[str, torch.Tensor], chunk_bytes: int) -> list[torch.Tensor]:
    """vLLM's packed stream, packed by vLLM's own ``pack_tensors`` (what its stock trainer
    broadcasts)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    items = iter(tensors.items())
    chunks = []
    while (chunk := pack_tensors(items, lambda item: item[1], chunk_bytes)) is not None:
        chunks.append(chunk.packed_tensor)
    return chunks


def broadcast_all(group: Group, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        group.wait(group.broadcast(t))


def test_vllms_own_client_updates_a_vllm_engine_worker_through_a_session(worker: Served) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url, b = worker.url, worker.b_tensors
    client = HTTPVLLMWeightSyncClient(url, timeout=120)
    assert requests.post(f"{url}/pause?mode=abort", timeout=60).json() == {"status": "paused"}
    assert requests.get(f"{url}/is_paused", timeout=30).json() == {"is_paused": True}
    port = free_port()
    _store, joined = trainer_group(port, "vllm")
    client.init_weight_transfer_engine(init_info(port))
    group = joined.result(timeout=60)
    try:
        # Per-tensor broadcasts in vLLM's stock shape, with the trainer's hashes.
        client.start_weight_update()
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(
                client.update_weights, stock_update_info(b, hashes=[tensor_hash(t) for t in b.values()])
            )
            broadcast_all(group, [t.contiguous() for t in b.values()])
            sent.result(timeout=120)
        assert worker.state()["version"] == "a" and worker.state()["session_open"]  # not committed yet
        client.finish_weight_update("step-b")
        assert requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"] == "step-b"
        state = worker.state()
        assert (state["session_open"], state["torn"], state["verified"]) == (False, False, True)
        assert state["digest"] == weights_digest(tensor_hashes(b.items()))
        assert worker.client.engine_rpc("weight_hashes")["result"] == tensor_hashes(b.items())
        assert requests.post(f"{url}/resume", timeout=60).json() == {"status": "resumed"}
        assert greedy(worker.client) == worker.b_outputs != worker.a_outputs
    finally:
        client.shutdown_weight_transfer_engine()
        group.close()


def test_vllm_033s_own_trainer_updates_a_vllm_engine_worker_twice_the_second_with_empty_lists(
    worker: Served, tmp_path: Path
) -> None:
    """vLLM 0.33.0's own ``NCCLTrainerWeightTransferEngine.send_weights``, run from the released
    wheel in a subprocess (:class:`tests.peers.test_vllm_033_wheel.Sender`: 0.33's engine,
    ``ModuleSource`` and ``HTTPVLLMWeightSyncClient``, its NCCL communicator a gloo group),
    against the vLLM engine: b's weights, then a's with ``names``, ``dtype_names`` and ``shapes``
    empty ("the previous call's"); each served exactly (digest, greedy outputs).  The engine's
    vLLM worker process joins 0.33's group as it joins any plain gloo rank 0."""
    from tests.peers.test_vllm_033_wheel import Sender

    url, a, b = worker.url, dict(worker.a_tensors), dict(worker.b_tensors)
    assert requests.post(f"{url}/pause?mode=abort", timeout=60).json() == {"status": "paused"}
    sender = Sender(url, [b, a], tmp_path, free_port())
    try:
        init = sender.next_report()
        assert init["vllm"][0] == "0.33.0"
        assert [c["path"] for c in init["calls"]] == ["init_weight_transfer_engine"]
        one = sender.next_report()
        assert [c["path"] for c in one["calls"]] == [
            "start_weight_update", "update_weights", "finish_weight_update",
        ]  # fmt: skip
        assert one["calls"][1]["json"]["update_info"] == stock_update_info(b)
        state = worker.state()
        assert state["digest"] == weights_digest(tensor_hashes(b.items()))
        assert not state["torn"] and not state["session_open"]
        assert requests.post(f"{url}/resume", timeout=60).json() == {"status": "resumed"}
        assert greedy(worker.client) == worker.b_outputs

        assert requests.post(f"{url}/pause?mode=abort", timeout=60).json() == {"status": "paused"}
        sender.go_on()
        two = sender.next_report()
        # what 0.33 sends when its metadata did not change
        unchanged: dict[str, list[Any]] = {"names": [], "dtype_names": [], "shapes": []}
        assert two["calls"] == [
            {"path": "start_weight_update", "json": None},
            {"path": "update_weights", "json": {"update_info": unchanged}},
            {"path": "finish_weight_update", "json": None},
        ]
        state = worker.state()
        assert state["digest"] == weights_digest(tensor_hashes(a.items()))
        assert not state["torn"] and not state["session_open"]
        assert requests.post(f"{url}/resume", timeout=60).json() == {"status": "resumed"}
        assert greedy(worker.client) == worker.a_outputs

        done = sender.next_report()
        assert [c["path"] for c in done["calls"]] == ["shutdown_weight_transfer_engine"]
        assert sender.close() == 0, sender.output()
    finally:
        sender.close()


def test_vllms_packed_stream_takes_a_vllm_engine_worker_back(worker: Served) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = worker.url
    worker.client.pause_generation("wait")
    worker.client.update_weights_from_disk(str(worker.b), weight_version="b")
    client = HTTPVLLMWeightSyncClient(url, timeout=120)
    chunk = 1 << 20  # above the largest tensor (vLLM warns otherwise)
    port = free_port()
    _store, joined = trainer_group(port, "vllm")
    client.init_weight_transfer_engine(init_info(port, packed=True, packed_buffer_size_bytes=chunk))
    group = joined.result(timeout=60)
    a = worker.a_tensors
    try:
        client.start_weight_update()
        chunks = packed_chunks(a, chunk)
        assert len(chunks) > 1
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(
                client.update_weights, stock_update_info(a, hashes=[tensor_hash(t) for t in a.values()])
            )
            broadcast_all(group, chunks)
            sent.result(timeout=120)
        client.finish_weight_update("a-packed")
    finally:
        client.shutdown_weight_transfer_engine()
        group.close()
    state = worker.state()
    assert state["version"] == "a-packed" and state["digest"] == weights_digest(tensor_hashes(a.items()))
    requests.post(f"{url}/resume", timeout=60)
    assert greedy(worker.client) == worker.a_outputs


def test_vllms_trainer_flow_with_the_weightsync_backend_reaches_a_vllm_engine_worker(
    worker: Served,
) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from weightsync.trainer.vllm_backend import WeightSyncTrainerInitInfo, register

    class Weights(WeightSource):
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.tensors = tensors

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(self.tensors.items())

    register()
    url = worker.url
    requests.post(f"{url}/pause?mode=wait", timeout=60)
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0,
                                  bucket_bytes=256 * 1024, timeout_s=300),
        client=HTTPVLLMWeightSyncClient(url, timeout=120),
        source=Weights(worker.b_tensors),
    )  # fmt: skip
    try:
        engine.send_weights()
        state = worker.state()
        assert (state["torn"], state["verified"]) == (False, True)
        assert state["digest"] == weights_digest(tensor_hashes(worker.b_tensors.items()))
        requests.post(f"{url}/resume", timeout=60)
        assert greedy(worker.client) == worker.b_outputs
        requests.post(f"{url}/pause?mode=wait", timeout=60)
        engine.source = Weights(worker.a_tensors)
        engine.send_weights()  # a second round on the same group
        requests.post(f"{url}/resume", timeout=60)
        assert greedy(worker.client) == worker.a_outputs
    finally:
        engine.shutdown()


def test_sglangs_routes_update_a_vllm_engine_worker(worker: Served) -> None:
    url = worker.url

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = requests.post(f"{url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        reply: dict[str, Any] = r.json()
        assert reply["success"] is True, reply
        return reply

    # A running worker: SGLang's disk update pauses, loads, declares and continues.
    post("/update_weights_from_disk", {"model_path": str(worker.b), "weight_version": "sg-b"})
    assert requests.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"] == "sg-b"
    assert not worker.state()["paused"]
    assert greedy(worker.client) == worker.b_outputs
    # A refused update: success false, nothing changed.
    r = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(worker.root / "nope")},
                      timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["success"] is False
    assert worker.state()["version"] == "sg-b" and not worker.state()["torn"]
    # A flattened_bucket broadcast inside a begin/end session takes it back to a.
    post("/pause_generation", {"mode": "retract"})
    port = free_port()
    with ThreadPoolExecutor(
        1
    ) as forming:  # SGLang's own init_custom_process_group (tests/peers/sglang_calls.py)
        joined = forming.submit(
            init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, "weight_update_group",
            datetime.timedelta(seconds=300),
        )  # fmt: skip
        post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "weight_update_group", "backend": "gloo"})  # fmt: skip
        group = joined.result(timeout=60)
    a = worker.a_tensors
    try:
        post("/begin_weight_update", {})
        body = {
            "names": list(a), "dtypes": [str(t.dtype).removeprefix("torch.") for t in a.values()],
            "shapes": [list(t.shape) for t in a.values()], "group_name": "weight_update_group",
            "load_format": "flattened_bucket", "weight_version": "sg-a", "flush_cache": True,
        }  # fmt: skip
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in a.values()])
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(
                requests.post, f"{url}/update_weights_from_distributed", json=body, timeout=120
            )
            dist.broadcast(flat, 0, group=group)
            reply = sent.result(timeout=120)
        assert reply.status_code == 200 and reply.json()["success"], reply.text
        end = post("/end_weight_update", {})
        assert end["digest"] == weights_digest(tensor_hashes(a.items()))
    finally:
        requests.post(f"{url}/destroy_weights_update_group", json={}, timeout=60)
        dist.destroy_process_group(group)
    assert requests.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"] == "sg-a"
    post("/continue_generation", {})
    assert greedy(worker.client) == worker.a_outputs
