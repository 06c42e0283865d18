"""TRL 1.16's AsyncGRPO against a weightsync worker, with TRL's own client: the ``VLLMClient`` of
``trl/experimental/async_grpo/vllm_client.py`` (imported unchanged) makes every HTTP call of
``WeightTransferClient.init_weight_transfer`` and ``send_weights``
(``trl/experimental/async_grpo/weight_transfer.py``) and of the trainer's start-up.

Start-up reads ``max_model_len`` from ``/v1/models`` and ``model_config.dtype`` from
``/server_info?config_format=json`` (a worker that served neither stopped AsyncGRPO with a
``KeyError`` before its first sync); a sync is ``pause(mode=keep)``, ``start_weight_update``
(``is_checkpoint_format: true``), ``update_weights`` beside the packed broadcast,
``finish_weight_update`` with no body, ``resume``.  Where CPU stops: the packed broadcast is
vLLM's ``pack_tensors`` chunks on a gloo group (:func:`tests.peers.test_vllm_trl_client.packed_chunks`),
since ``packed_nccl_broadcast_producer`` needs CUDA streams.
"""

from __future__ import annotations

import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.helpers import TINY, perturbed
from tests.peers.test_vllm_trl_client import packed_chunks
from tests.peers.torch_trainer import PlainTrainer
from tests.peers.vllm_calls import make_vllm_worker
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import weights_digest

__all__ = ["make_vllm_worker"]

pytestmark = pytest.mark.slow

with warnings.catch_warnings():  # TRL warns that trl.experimental may change: AsyncGRPO lives there
    warnings.simplefilter("ignore")
    from trl.experimental.async_grpo.vllm_client import VLLMClient


def test_async_grpos_start_up_reads_are_answered_truthfully(make_vllm_worker: Any) -> None:
    from accelerate import PartialState

    PartialState()  # the trainer's Accelerator sets it up before the client logs
    client = VLLMClient(make_vllm_worker(dialect="vllm"), server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.1)
    assert client.get_max_model_len() == TINY.max_position
    assert client.get_dtype() == f"torch.{TINY.dtype}"  # vLLM stringifies the torch dtype
    assert client.get_dtype().removeprefix("torch.") == "float32"  # what AsyncGRPO compares with
    assert client.get_server_info()["weight_transfer_config"] is not None
    assert client.get_world_size() == 1


def test_an_async_grpo_sync_with_trls_client_lands_and_resumes(make_vllm_worker: Any) -> None:
    url = make_vllm_worker(dialect="vllm")
    client = VLLMClient(url, server_timeout=30)
    weights = perturbed(dict(ReferenceEngine(TINY).model.weights()), seed=7)
    update_info = {
        "names": list(weights),
        "dtype_names": [str(t.dtype).split(".")[-1] for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
    }
    assert Counter(update_info["dtype_names"]).most_common(1)[0][0] == client.get_dtype().removeprefix(
        "torch."
    )
    trainer = PlainTrainer(client.get_world_size() + 1)
    try:
        init_info = {**trainer.init_info(), "packed": True}  # init_weight_transfer's, on gloo
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, init_info, timeout=60)
            trainer.joined()
            joined.result(timeout=60)
        client.pause()  # mode=keep
        client.start_weight_update(timeout=60)
        with ThreadPoolExecutor(1) as pool:
            posted = pool.submit(client.update_weights, update_info, timeout=120)
            for chunk in packed_chunks(weights):
                trainer.wait(trainer.broadcast(chunk))
            posted.result(timeout=120)
        client.finish_weight_update(timeout=60)
        client.resume()
        state = requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json()
        assert state["digest"] == weights_digest(weights) and not state["paused"] and not state["torn"]
    finally:
        trainer.close()
