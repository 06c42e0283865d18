"""vLLM's stock trainer rendezvous, run with vLLM's own code against a weightsync worker on CPU.

vLLM's ``nccl_common.trainer_init`` (what ``NCCLTrainerWeightTransferEngine`` and TRL 1.16's
``VLLMClient.init_communicator`` call) is ``StatelessProcessGroup.create(host, port, rank=0,
world_size)`` and then ``PyNcclCommunicator(pg, device)``.  Here rank 0 is vLLM's real
``StatelessProcessGroup.create``; ``PyNcclCommunicator.__init__`` cannot run without NCCL, so
its one store step is reproduced call for call (``vllm/distributed/device_communicators/
pynccl.py``: rank 0's ``unique_id = nccl.ncclGetUniqueId()``, then
``group.broadcast_obj(unique_id, src=0)``), with 128 random bytes for the id NCCL would mint.

Where CPU stops: the worker joins the store as a counted member (``create`` returns only once
it has), reads the id, and answers ``501 nccl_unavailable`` right before ``ncclCommInitRank``.
A store value that is anything but the id's pickle is refused without being unpickled.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.helpers import free_port
from tests.peers.vllm_calls import make_vllm_worker

__all__ = ["make_vllm_worker"]

pytestmark = pytest.mark.slow


def random_unique_id() -> Any:
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    uid = ncclUniqueId()
    for i, b in enumerate(os.urandom(128)):
        uid.internal[i] = b - 256 if b > 127 else b
    return uid


def rendezvous(url: str, publish: Any, **init: Any) -> requests.Response:
    """vLLM's ``trainer_init`` rank 0 beside the worker's ``/init_weight_transfer_engine`` (vLLM's
    stock ``init_info``: no backend, nccl); ``publish(pg)`` is rank 0's first store step."""
    from vllm.distributed.utils import StatelessProcessGroup

    port = free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, **init}
    with ThreadPoolExecutor(2) as pool:
        creating = pool.submit(StatelessProcessGroup.create, "127.0.0.1", port, 0, 2, store_timeout=60)
        posted = pool.submit(
            requests.post, f"{url}/init_weight_transfer_engine", json={"init_info": info}, timeout=120
        )
        pg = creating.result(timeout=60)  # returns only once the worker counted itself in
        publish(pg)
        return posted.result(timeout=120)


@pytest.fixture
def url(make_vllm_worker: Any) -> Iterator[str]:
    yield make_vllm_worker()


def state(url: str) -> dict[str, Any]:
    return dict(requests.post(f"{url}/engine/get_weight_version", json={}, timeout=60).json())


def test_vllms_stateless_rendezvous_is_joined_up_to_nccl(url: str) -> None:
    before = state(url)
    reply = rendezvous(url, lambda pg: pg.broadcast_obj(random_unique_id(), src=0))
    assert reply.status_code == 501, reply.text
    error = reply.json()["error"]
    assert error["type"] == "nccl_unavailable"
    assert "read the trainer's NCCL unique id" in error["message"] and "NCCL" in error["message"]
    assert state(url) == before
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


class WritesAFile:
    """A pickle whose ``__reduce__`` would create a file if anything unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (str(self.path), "w"))


def test_a_store_value_that_would_run_code_is_refused_unread(url: str, tmp_path: Path) -> None:
    planted = tmp_path / "pwned"
    before = state(url)
    reply = rendezvous(url, lambda pg: pg.broadcast_obj(WritesAFile(planted), src=0))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "bad_unique_id"
    assert not planted.exists()
    assert state(url) == before and requests.get(f"{url}/health", timeout=10).status_code == 200


def test_a_unique_id_of_the_wrong_size_is_refused(url: str) -> None:
    from vllm.distributed.device_communicators import pynccl_wrapper

    forged = pickle.dumps(random_unique_id()).replace(b"C\x80", b"C\x7f", 1)  # a 127-byte id
    reply = rendezvous(url, lambda pg: pg.store.set("broadcast_from/0/0", forged))
    assert pynccl_wrapper.NCCL_UNIQUE_ID_BYTES == 128
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "bad_unique_id"


def test_a_trainer_that_never_publishes_its_id_is_a_rendezvous_failure(url: str) -> None:
    reply = rendezvous(url, lambda pg: None, timeout_s=2)
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["type"] == "rendezvous_failed"
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_a_torch_free_trainers_unique_id_is_checked_as_vllm_checks_it(url: str) -> None:
    """``nccl_unique_id_b64`` (vLLM's torch-free rendezvous): vLLM's ``decode_nccl_unique_id``
    rules are kept (standard base64 of 128 bytes, not beside an address); a valid one is
    ``501``: a worker joins only through a store."""
    import base64

    def post(info: dict[str, Any]) -> requests.Response:
        return requests.post(f"{url}/init_weight_transfer_engine", json={"init_info": info}, timeout=60)

    good = base64.b64encode(os.urandom(128)).decode()
    bad = post({"nccl_unique_id_b64": good[:-4], "rank_offset": 1, "world_size": 2})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_value", bad.text
    both = post(
        {
            "nccl_unique_id_b64": good,
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
        }
    )
    assert both.status_code == 400 and both.json()["error"]["type"] == "conflicting_options", both.text
    alone = post({"nccl_unique_id_b64": good, "rank_offset": 1, "world_size": 2})
    assert alone.status_code == 501, alone.text
