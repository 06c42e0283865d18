"""OpenRLHF's weight broadcast, its trainer side call for call, against a worker's ``/engine/`` routes.

OpenRLHF's trainer (``openrlhf/trainer/ray/ppo_actor.py`` ``_broadcast_to_vllm``) forms its
group with ``openrlhf/utils/distributed_util.py`` ``init_process_group`` (a copy of torch's that
wraps the store in ``PrefixStore(group_name)``, the same copy as SGLang's
``init_custom_process_group``, reproduced in :mod:`tests.peers.sglang_calls`), group name
``"openrlhf"``, the engines at ``rank_offset`` 1; then, per parameter, rank 0 calls
``torch.distributed.broadcast(param.data, 0, group=self._model_update_group)`` while the engine
receives it (``vllm_worker_wrap.py`` ``update_weight(name, dtype, shape)``).  Through the
Dynamo-compatible routes the engine side is ``/engine/init_weights_update_group`` and one
``/engine/update_weights_from_distributed`` naming every tensor, in the trainer's order; on gloo
the group is joined with ``receiver: "process"``, since the bare stream's sizes are only the
request's word.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import torch.distributed as dist

from tests.helpers import TINY, free_port, fresh_output, greedy, perturbed
from tests.peers.sglang_calls import init_custom_process_group
from weightsync.core import Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import weights_digest

pytestmark = pytest.mark.slow

GROUP = "openrlhf"


def post(url: str, route: str, body: Any) -> requests.Response:
    return requests.post(f"{url}/engine/{route}", json=body, timeout=120)


def test_openrlhfs_group_and_per_parameter_broadcast_update_a_worker(tmp_path: Path) -> None:
    engine = ReferenceEngine(TINY)
    new = perturbed(engine.model.weights(), seed=41)
    with ServerThread(create_app(Controller(engine, paused=True))) as server:
        port = free_port()
        with ThreadPoolExecutor(2) as pool:
            forming = pool.submit(
                init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, GROUP,
                datetime.timedelta(seconds=60),
            )  # fmt: skip
            r = post(server.url, "init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": GROUP, "backend": "gloo", "receiver": "process",
            })  # fmt: skip
            assert r.status_code == 200, r.text
            group = forming.result(timeout=60)
            try:
                body = {
                    "names": list(new),
                    "dtypes": [str(t.dtype).removeprefix("torch.") for t in new.values()],
                    "shapes": [list(t.shape) for t in new.values()],
                    "group_name": GROUP,
                    "weight_version": "openrlhf-1",
                }
                sent = pool.submit(post, server.url, "update_weights_from_distributed", body)
                for param in new.values():
                    dist.broadcast(param.data.contiguous(), 0, group=group)
                reply = sent.result(timeout=120)
                assert reply.status_code == 200, reply.text
                state = post(server.url, "get_weight_version", {}).json()
                assert state["version"] == "openrlhf-1" and not state["torn"]
                assert state["verified"] is False  # a bare stream: nothing to check the bytes against
                assert state["digest"] == weights_digest(new)
                served = engine.model.weights()
                assert all(torch.equal(served[n], new[n]) for n in new)
                assert post(server.url, "resume_generation", {}).status_code == 200
                assert greedy(server.url) == fresh_output(tmp_path, new)
                assert (
                    post(server.url, "destroy_weights_update_group", {"group_name": GROUP}).status_code == 200
                )
            finally:
                dist.destroy_process_group(group)
