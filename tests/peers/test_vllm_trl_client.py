"""TRL 1.16's ``VLLMClient`` (``trl/generation/vllm_client.py``, the client behind
``GRPOTrainer(vllm_mode="server")``) against a real ``weightsync serve`` worker, its HTTP calls
reproduced one for one (TRL does not install beside the pinned stack here).

What each step follows, in ``VLLMClient``:

* ``__init__`` → ``check_server``: ``GET /health`` (200), then ``_get("/v1/models")["data"][0]["id"]``;
* ``init_communicator``: ``get_server_info`` (``GET /server_info?config_format=json``, its
  ``["vllm_config"]["weight_transfer_config"]`` must not be null), ``get_world_size``
  (``GET /get_world_size``), then ``POST /init_weight_transfer_engine`` with
  ``{"init_info": {master_address, master_port, "rank_offset": 1, world_size + 1, "packed": true}}``
  while the trainer joins the group (``vllm...nccl_common.trainer_init``);
* ``update_named_params`` (what ``VLLMGeneration.sync_weights`` calls): ``POST /start_weight_update``
  ``json={}``, ``POST /update_weights`` ``{"update_info": {names, dtype_names, shapes}}`` while
  ``packed_nccl_broadcast_producer`` broadcasts vLLM's packed chunks (``pack_tensors``, 1 GiB
  buffers), ``POST /finish_weight_update`` ``json={}``; no version is sent;
* ``reset_prefix_cache``: ``POST /reset_prefix_cache`` with no body, 200 with a JSON body.

TRL never pauses: its update runs on a serving worker, which ``--auto-pause-updates`` lets the
worker pause for.  One deviation, for a CPU-only run: TRL's trainer side is a NCCL
communicator (CUDA only, and TRL's ``init_communicator`` refuses a non-CUDA device); here it
is a plain ``torch.distributed.init_process_group("gloo")`` group at the same rendezvous
(:mod:`tests.peers.torch_trainer`), so the init names ``"backend": "gloo"`` and the rendezvous
address is loopback (TRL sends ``get_ip()``).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.helpers import TINY, WorkerProcess, fresh_output, greedy, perturbed
from tests.peers.torch_trainer import PlainTrainer
from tests.peers.vllm_calls import make_vllm_worker
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import weights_digest

__all__ = ["make_vllm_worker"]


def _get(url: str) -> Any:
    """``VLLMClient._get``: anything but 200 is a failure."""
    response = requests.get(url, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _post(url: str, **kwargs: Any) -> Any:
    """``VLLMClient._post``: anything but 200 is a failure; the reply is JSON."""
    response = requests.post(url, timeout=120, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def construct(base_url: str) -> str:
    """``VLLMClient.__init__``: ``check_server`` then the served model's id."""
    assert requests.get(f"{base_url}/health", timeout=60).status_code == 200
    return str(_get(f"{base_url}/v1/models")["data"][0]["id"])


def get_server_info(base_url: str) -> dict[str, Any]:
    """``VLLMClient.get_server_info``: 404 means no dev endpoints; the ``vllm_config`` tree."""
    response = requests.get(f"{base_url}/server_info", params={"config_format": "json"}, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json()["vllm_config"])


def packed_chunks(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What ``packed_nccl_broadcast_producer`` broadcasts: vLLM's own ``pack_tensors`` chunks
    at its default buffer size."""
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES, pack_tensors

    items = iter(tensors.items())
    chunks = []
    while (chunk := pack_tensors(items, lambda item: item[1], DEFAULT_PACKED_BUFFER_SIZE_BYTES)) is not None:
        chunks.append(chunk.packed_tensor)
    return chunks


def init_communicator(base_url: str) -> PlainTrainer:
    """``VLLMClient.init_communicator`` with a plain gloo group standing in for its NCCL one."""
    assert get_server_info(base_url)["weight_transfer_config"] is not None
    world_size = _get(f"{base_url}/get_world_size")["world_size"] + 1
    trainer = PlainTrainer(world_size)
    init_info = trainer.init_info(packed=True)
    with ThreadPoolExecutor(1) as pool:
        posted = pool.submit(_post, f"{base_url}/init_weight_transfer_engine", json={"init_info": init_info})
        trainer.joined()
        posted.result(timeout=60)
    return trainer


def update_named_params(base_url: str, group: PlainTrainer, tensors: dict[str, torch.Tensor]) -> None:
    """``VLLMClient.update_named_params`` outside a ``weight_update`` block."""
    metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()]
    names, dtype_names, shapes = (list(field) for field in zip(*metadata, strict=True))
    update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
    _post(f"{base_url}/start_weight_update", json={})
    with ThreadPoolExecutor(max_workers=1) as executor:
        future = executor.submit(_post, f"{base_url}/update_weights", json={"update_info": update_info})
        for chunk in packed_chunks(tensors):
            group.wait(group.broadcast(chunk))
        future.result(timeout=120)
    _post(f"{base_url}/finish_weight_update", json={})


@pytest.fixture
def auto_pausing(tmp_path: Path) -> Iterator[WorkerProcess]:
    worker = WorkerProcess("--allowed-weight-dir", str(tmp_path), "--auto-pause-updates")
    try:
        yield worker.wait_ready()
    finally:
        worker.stop()


def state(url: str) -> dict[str, Any]:
    return dict(requests.post(f"{url}/engine/get_weight_version", json={}, timeout=60).json())


def test_trls_client_constructs_and_reads_the_server_info_it_checks(make_vllm_worker: Any) -> None:
    """``VLLMClient.__init__`` and the reads of ``init_communicator`` / ``GRPOTrainer``: the
    served id, a non-null ``weight_transfer_config``, ``model_config.logprobs_mode`` and the
    world size."""
    url = make_vllm_worker()
    assert construct(url) == "reference"
    info = get_server_info(url)
    assert info["weight_transfer_config"] == {"backend": "nccl"}
    assert info["model_config"]["logprobs_mode"] == "raw_logprobs"  # what a worker does, not what GRPO wants
    assert info["parallel_config"]["data_parallel_size"] == 1 and info["lora_config"] is None
    assert _get(f"{url}/get_world_size")["world_size"] == 1


def test_trls_update_without_auto_pause_is_refused_and_changes_nothing(make_vllm_worker: Any) -> None:
    """``update_named_params``' first call, ``POST /start_weight_update json={}``, on a serving
    worker started without ``--auto-pause-updates``: 409 ``not_paused`` naming the flag."""
    url = make_vllm_worker()
    before = state(url)
    r = requests.post(f"{url}/start_weight_update", json={}, timeout=60)
    assert r.status_code == 409
    assert (
        r.json()["error"]["type"] == "not_paused" and "--auto-pause-updates" in r.json()["error"]["message"]
    )
    assert state(url) == before


@pytest.mark.slow
def test_trls_weight_sync_updates_a_serving_worker_that_pauses_for_it(
    auto_pausing: WorkerProcess, tmp_path: Path
) -> None:
    """``init_communicator`` once, then two rounds of ``VLLMGeneration.sync_weights``
    (``update_named_params`` and ``reset_prefix_cache``) on a serving worker: each round's
    weights are served (digest and greedy outputs equal a fresh engine's), the worker serves
    again after each, and the label follows weightsync's rule for an update without a version:
    the declared label stays, ``version_current: false``."""
    url = auto_pausing.url
    construct(url)
    requests.post(f"{url}/engine/set_weight_version", json={"weight_version": "before"}, timeout=60)
    group = init_communicator(url)
    try:
        for seed in (21, 22):
            new = perturbed(ReferenceEngine(TINY).model.weights(), seed=seed)
            update_named_params(url, group, new)
            now = state(url)
            assert not now["paused"] and not now["torn"] and not now["session_open"]
            assert now["digest"] == weights_digest(new)
            # No version sent: the declared label stays, and says it no longer describes the weights.
            assert now["version"] == "before" and now["version_declared"] and now["version_current"] is False
            assert requests.get(f"{url}/weight_info", timeout=60).json()["weight_version"] == "before"
            assert _post(f"{url}/reset_prefix_cache") == {"success": True}
            assert greedy(url) == fresh_output(tmp_path / str(seed), new)
    finally:
        group.close()
