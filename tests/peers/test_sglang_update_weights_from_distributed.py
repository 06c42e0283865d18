"""SGLang's own checks of ``/update_weights_from_distributed``, re-run against a weightsync worker.

Followed one for one: ``test/srt/rl/test_update_weights_from_distributed.py`` in
sgl-project/sglang, the server backend of ``init_process_sgl`` (HTTP) against the trainer of
``init_process_hf``: ``/init_weights_update_group`` with ``master_address: "localhost"`` and
``master_port`` as a string (``str(port)``), ``/update_weights_from_distributed`` with
``names``/``dtypes``/``shapes``/``group_name`` while rank 0 broadcasts each tensor, the served
parameters checked against the trainer's (SGLang reads them back with
``/get_weights_by_name``, which a worker does not serve; the engine's tensors are read here),
then ``/destroy_weights_update_group`` answering 200.  gloo instead of NCCL (CPU).

The trainer forms its group with SGLang's own ``init_custom_process_group``
(:mod:`tests.peers.sglang_calls`, call for call: a ``tcp://`` rendezvous whose rank 0 hosts the
store, ``PrefixStore(group_name)``, torch's ``_new_process_group_helper``), with ``master_port``
sent as a numeric string (as SGLang's test does) and as an int (as Miles does); the stream is
bare per tensor (``init_process_hf``) or one ``flattened_bucket`` broadcast
(``sglang/srt/weight_sync/tensor_bucket.py`` ``FlattenedTensorBucket``: the tensors flattened and
concatenated).  The worker then serves exactly the trainer's tensors: the digest it reports is
the digest of a checkpoint of them, and its greedy output is a fresh worker's on them.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers import free_port, fresh_output, greedy, perturbed
from tests.peers.sglang_calls import init_custom_process_group
from tests.peers.sglang_worker import SglangWorker, sglang_worker
from weightsync.trainer import weights_digest

__all__ = ["sglang_worker"]

pytestmark = pytest.mark.slow

GROUP = "test_parameter_update_group"


def init_group(worker: SglangWorker, port: int | str) -> Any:
    """``init_process_sgl``'s ``/init_weights_update_group`` (its ``backend`` nccl, gloo here)."""
    return worker.post("/init_weights_update_group", {
        "master_address": "localhost", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": GROUP, "backend": "gloo",
    })  # fmt: skip


def sglang_trainer_group(worker: SglangWorker, port_as: type) -> Any:
    """Rank 0 of SGLang's ``init_custom_process_group`` (gloo), formed while the worker joins
    through ``/init_weights_update_group`` (its reply asserted); returns rank 0's group."""
    port = free_port()
    timeout = datetime.timedelta(seconds=60)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(
            init_custom_process_group, "gloo", f"tcp://localhost:{port}", 2, 0, GROUP, timeout
        )
        r = init_group(worker, port_as(port))
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        return joining.result(timeout=60)


def update_and_broadcast(
    worker: SglangWorker, base: dict[str, torch.Tensor], group: Any, *, flattened: bool = False, **extra: Any
) -> Any:
    """``init_process_sgl``'s ``/update_weights_from_distributed`` beside ``init_process_hf``'s
    broadcasts from rank 0: of every parameter, or of their ``FlattenedTensorBucket``."""
    body = {
        "names": list(base),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in base.values()],
        "shapes": [list(t.shape) for t in base.values()],
        "group_name": GROUP,
        **({"load_format": "flattened_bucket"} if flattened else {}),
        **extra,
    }
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(worker.post, "/update_weights_from_distributed", body)
        tensors = [torch.cat([t.flatten() for t in base.values()])] if flattened else list(base.values())
        for t in tensors:
            dist.broadcast(t.contiguous(), 0, group=group)
        return sent.result(timeout=120)


@pytest.mark.parametrize(
    ("port_as", "flattened"),
    [(str, False), (int, True)],
    ids=["str-port-per-tensor", "int-port-flattened-bucket"],
)
def test_update_weights_from_distributed_serves_the_trainers_parameters(
    sglang_worker: SglangWorker, tmp_path: Any, port_as: type, flattened: bool
) -> None:
    instruct = {k: v.clone() for k, v in sglang_worker.engine.model.weights().items()}
    base = perturbed(instruct, seed=11)
    group = sglang_trainer_group(sglang_worker, port_as)
    try:
        reply = update_and_broadcast(sglang_worker, base, group, flattened=flattened, weight_version="sg-1")
        assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
        served = sglang_worker.engine.model.weights()
        for name in base:
            assert torch.equal(served[name], base[name]), name
            assert not torch.equal(base[name], instruct[name]), name
        state = sglang_worker.get("/get_weight_version").json()
        assert state["weight_version"] == "sg-1"
        assert state["digest"] == weights_digest(base)
        assert greedy(sglang_worker.url) == fresh_output(tmp_path, base)
        r = sglang_worker.post("/destroy_weights_update_group", {"group_name": GROUP})
        assert r.status_code == 200, r.text
    finally:
        dist.destroy_process_group(group)
