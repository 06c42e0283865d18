"""Update sessions driven the way vLLM's and SGLang's trainers drive them, on real workers:
vLLM's own ``HTTPVLLMWeightSyncClient`` against a ``weightsync serve`` process over a real
gloo group, SGLang-shaped session and flattened-bucket requests, and abandoned sessions."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import torch.distributed as dist

from tests.helpers import TINY, WorkerProcess, free_port, fresh_output, greedy, perturbed, vllm_weight_source
from tests.peers.torch_trainer import PlainTrainer
from weightsync.core import Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import save_checkpoint, weights_digest
from weightsync.transports.distributed.group import Group, create_group
from weightsync.transports.hashing import tensor_hash

pytestmark = pytest.mark.slow


def trainer_group(port: int, name: str = "vllm", world_size: int = 2) -> tuple[Any, Any]:
    """A TCPStore hosted at ``port`` and a thread that joins as rank 0 once the worker joins; on
    the vLLM dialect's group, a plain ``init_process_group`` trainer (``tests/peers/torch_trainer.py``)."""
    if name == "vllm":
        return None, PlainTrainer(world_size, port=port).ready()
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
    )
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(
        create_group, name, master_address="127.0.0.1", master_port=port, rank=0,
        world_size=world_size, backend="gloo", timeout_s=60, store=store,
    )  # fmt: skip
    return store, fut


def broadcast_each(group: Group, tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        group.wait(group.broadcast(t.contiguous()))


@pytest.fixture
def served_process(tmp_path: Path) -> Iterator[WorkerProcess]:
    worker = WorkerProcess("--model-config", "tiny", "--allowed-weight-dir", str(tmp_path))
    try:
        yield worker.wait_ready()
    finally:
        worker.stop()


def test_vllms_own_client_drives_a_weightsync_worker_through_a_session(
    served_process: WorkerProcess, tmp_path: Path
) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = served_process.url
    new = perturbed(ReferenceEngine(TINY).model.weights(), seed=11)
    client = HTTPVLLMWeightSyncClient(url, timeout=120)
    assert requests.post(f"{url}/pause?mode=abort", timeout=30).json() == {"status": "paused"}
    port = free_port()
    _store, joining = trainer_group(port)
    client.init_weight_transfer_engine(
        {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "gloo",
        }
    )
    group = joining.result(timeout=60)
    client.start_weight_update()
    info = {
        "names": list(new),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in new.values()],
        "shapes": [list(t.shape) for t in new.values()],
        "hashes": [tensor_hash(t) for t in new.values()],
    }
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(client.update_weights, info)
        broadcast_each(group, new)
        sent.result(timeout=120)
    state = requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
    assert state["session_open"] and state["torn"] and state["version"] is None  # nothing committed yet
    client.finish_weight_update("step-1")
    assert requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"] == "step-1"
    state = requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
    assert not state["session_open"] and not state["torn"] and state["verified"] is True
    assert state["digest"] == weights_digest(new)
    assert requests.post(f"{url}/resume", timeout=30).json() == {"status": "resumed"}
    assert greedy(url) == fresh_output(tmp_path, new)
    client.shutdown_weight_transfer_engine()
    group.close()


def test_a_session_update_without_hashes_is_reported_unverified(served_process: WorkerProcess) -> None:
    url = served_process.url
    new = perturbed(ReferenceEngine(TINY).model.weights(), seed=12)
    requests.post(f"{url}/pause?mode=wait", timeout=30)
    port = free_port()
    _store, joining = trainer_group(port)
    r = requests.post(f"{url}/init_weight_transfer_engine", json={"init_info": {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"}}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    group = joining.result(timeout=60)
    requests.post(f"{url}/start_weight_update", timeout=30)
    info = {"names": list(new), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in new.values()],
            "shapes": [list(t.shape) for t in new.values()]}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(requests.post, f"{url}/update_weights", json={"update_info": info}, timeout=120)
        broadcast_each(group, new)
        assert sent.result(timeout=120).status_code == 200
    requests.post(f"{url}/finish_weight_update", json={"weight_version": "unchecked"}, timeout=30)
    state = requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
    assert state["version"] == "unchecked" and state["verified"] is False
    group.close()


# ---------------------------------------------------------------- abandoned sessions


@pytest.fixture
def short_deadline(tmp_path: Path) -> Iterator[tuple[str, ReferenceEngine, Path]]:
    engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path])
    controller = Controller(engine, session_timeout_s=0.5)
    with ServerThread(create_app(controller)) as server:
        yield server.url, engine, tmp_path


def admin(url: str, route: str, body: Any = None) -> dict[str, Any]:
    return requests.post(f"{url}/engine/{route}", json=body or {}, timeout=60).json()


def wait_closed(url: str, limit: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        state = admin(url, "get_weight_version")
        if not state["session_open"]:
            return state
        time.sleep(0.05)
    raise AssertionError("the session was not abandoned within its deadline")


def test_a_session_abandoned_after_start_leaves_the_worker_untouched(short_deadline: Any) -> None:
    url, _engine, _root = short_deadline
    admin(url, "pause_generation", {"mode": "wait"})
    before = admin(url, "get_weight_version")
    assert admin(url, "begin_weight_update")["session_open"] is True
    state = wait_closed(url)
    assert not state["torn"] and state["paused"] and state["digest"] == before["digest"]
    assert admin(url, "liveness_probe")["alive"] is True
    assert admin(url, "resume_generation")["status"] == "ok"


def test_a_session_abandoned_between_two_updates_is_torn_then_healed(short_deadline: Any) -> None:
    url, engine, root = short_deadline
    weights = engine.model.weights()
    first = dict(list(perturbed(weights, seed=21).items())[:2])
    path = save_checkpoint(first, root / "part")
    admin(url, "pause_generation", {"mode": "wait"})
    admin(url, "begin_weight_update")
    r = admin(
        url, "update_weights_from_disk", {"model_path": str(path), "allow_partial": True, "session": True}
    )
    assert r["status"] == "ok" and r["version_declared"] is False, r
    state = wait_closed(url)
    assert state["torn"] and state["digest"] is None and state["version"] is None
    assert admin(url, "resume_generation")["code"] == "weights_torn"
    assert admin(url, "liveness_probe")["alive"] is True
    full = perturbed(weights, seed=22)
    healed = admin(
        url,
        "update_weights_from_disk",
        {"model_path": str(save_checkpoint(full, root / "full")), "weight_version": "healed"},
    )
    assert healed["status"] == "ok" and healed["digest"] == weights_digest(full)
    assert admin(url, "resume_generation")["status"] == "ok"


def test_session_rules_start_twice_update_or_finish_without_one(short_deadline: Any) -> None:
    url, _engine, root = short_deadline
    assert admin(url, "begin_weight_update")["code"] == "not_paused"
    assert admin(url, "end_weight_update")["code"] == "no_session"
    admin(url, "pause_generation", {"mode": "wait"})
    before = admin(url, "get_weight_version")
    assert (
        admin(url, "update_weights_from_disk", {"model_path": str(root / "x"), "session": True})["code"]
        == "no_session"
    )
    admin(url, "begin_weight_update")
    assert admin(url, "begin_weight_update")["code"] == "session_open"
    assert admin(url, "set_weight_version", {"weight_version": "sneaky"})["code"] == "session_open"
    assert admin(url, "update_weights_from_disk", {"model_path": str(root / "x")})["code"] == "session_open"
    assert admin(url, "abort_weight_update") == {
        "status": "ok",
        "torn": False,
        "paused": True,
        "digest": before["digest"],
    }
    assert admin(url, "get_weight_version")["version"] is None


# ---------------------------------------------------------------- SGLang


def test_sglang_flattened_bucket_update_inside_a_begin_end_session(tmp_path: Path) -> None:
    engine = ReferenceEngine(TINY)
    controller = Controller(engine)
    new = perturbed(engine.model.weights(), seed=31)
    with ServerThread(create_app(controller)) as server:
        url = server.url
        assert requests.post(f"{url}/pause_generation", json={"mode": "retract"}, timeout=30).json()[
            "success"
        ]
        port = free_port()
        _store, joining = trainer_group(port, "weight_update_group")
        r = requests.post(f"{url}/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "weight_update_group", "backend": "gloo"}, timeout=60)  # fmt: skip
        assert r.json()["success"], r.text
        group = joining.result(timeout=60)
        assert requests.post(f"{url}/begin_weight_update", json={}, timeout=30).json()["success"]
        body = {
            "names": list(new), "dtypes": [str(t.dtype).removeprefix("torch.") for t in new.values()],
            "shapes": [list(t.shape) for t in new.values()], "group_name": "weight_update_group",
            "load_format": "flattened_bucket", "weight_version": "step-9", "flush_cache": True,
        }  # fmt: skip
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in new.values()])
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(
                requests.post, f"{url}/update_weights_from_distributed", json=body, timeout=120
            )
            group.wait(group.broadcast(flat))
            reply = sent.result(timeout=120)
        assert reply.status_code == 200 and reply.json()["success"], reply.text
        assert controller.snapshot().session_open and controller.snapshot().paused
        end = requests.post(f"{url}/end_weight_update", json={}, timeout=30).json()
        assert end["success"] and end["digest"] == weights_digest(new)
        assert requests.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"] == "step-9"
        assert requests.post(f"{url}/continue_generation", json={}, timeout=30).json()["success"]
        assert not controller.snapshot().paused
        bad = requests.post(f"{url}/end_weight_update", json={}, timeout=30)
        assert (
            bad.status_code == 400 and bad.json()["success"] is False and bad.json()["code"] == "no_session"
        )
        requests.post(f"{url}/destroy_weights_update_group", json={}, timeout=30)
        group.close()


def test_vllms_trainer_flow_with_the_weightsync_backend_over_gloo(served_process: WorkerProcess) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from weightsync.trainer.vllm_backend import WeightSyncTrainerInitInfo, register

    register()
    url = served_process.url
    new = perturbed(ReferenceEngine(TINY).model.weights(), seed=41)
    requests.post(f"{url}/pause?mode=wait", timeout=30)
    info = WeightSyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url, timeout=120), source=vllm_weight_source(new)
    )
    engine.send_weights()
    state = requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
    assert not state["session_open"] and not state["torn"] and state["verified"] is True
    assert state["digest"] == weights_digest(new)
    again = perturbed(new, seed=42)
    engine.source = vllm_weight_source(again)
    engine.send_weights()  # a second round on the same group
    assert requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()[
        "digest"
    ] == weights_digest(again)
    engine.shutdown()


def test_the_weightsync_backend_takes_vllm_033s_weight_source(served_process: WorkerProcess) -> None:
    """vLLM 0.33's ``WeightSource``: ``metadata`` a ``functools.cached_property`` of ``ParamMeta``
    and the pairs from ``iter_full()`` (iterating the source is gone), as 0.33's ``ModuleSource``
    (``vllm/distributed/weight_transfer/base.py``) has them."""
    import functools

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from weightsync.trainer.vllm_backend import WeightSyncTrainerInitInfo, register

    class Source033:
        def __init__(self, weights: dict[str, torch.Tensor]) -> None:
            self.weights = weights

        @functools.cached_property
        def metadata(self) -> list[Any]:
            meta = vllm_weight_source(self.weights).metadata()
            return list(meta)

        def iter_full(self) -> Any:
            yield from self.weights.items()

        def __iter__(self) -> Any:
            raise TypeError("vLLM 0.33's WeightSource is not iterable: use iter_full()")

    register()
    url = served_process.url
    new = perturbed(ReferenceEngine(TINY).model.weights(), seed=43)
    requests.post(f"{url}/pause?mode=wait", timeout=30)
    info = WeightSyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url, timeout=120), source=Source033(new)
    )
    engine.send_weights()
    state = requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
    assert state["digest"] == weights_digest(new) and not state["torn"]
    engine.shutdown()


def test_the_weightsync_backend_is_in_both_of_vllms_factories() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from weightsync.engines.vllm.transfer import WeightSyncUpdateInfo, WeightSyncWeightTransferEngine
    from weightsync.trainer.vllm_backend import WeightSyncTrainerWeightTransferEngine, register

    register()
    register()  # idempotent
    assert WeightTransferTrainerFactory._registry["weightsync"]() is WeightSyncTrainerWeightTransferEngine
    assert WeightTransferEngineFactory._registry["weightsync"]() is WeightSyncWeightTransferEngine
    info = WeightSyncUpdateInfo(
        names=["a"], dtype_names=["float32"], shapes=[[2]], packing={"bucket_bytes": 8, "stream_id": "s"}
    )
    assert info.packing["stream_id"] == "s"
