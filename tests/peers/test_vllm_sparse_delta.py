"""vLLM's sparse trainer (``vllm/distributed/weight_transfer/sparse_nccl_engine.py``) driving a
weightsync worker through the vLLM dialect, over gloo on CPU, on both engines: a reference
worker (a fresh one per test) and a ``weightsync serve --engine vllm`` worker on a tiny Llama
(one for the module, put back on its checkpoint after each test).

``SparseNCCLTrainerWeightTransferEngine.send_weights`` runs as vLLM wrote it (its patch checks,
its ``update_info``, its start → update (on a thread) → broadcasts → finish), with vLLM's
``HTTPVLLMWeightSyncClient``.  Where CPU stops: its ``PyNcclCommunicator`` is a gloo group with
the same ``broadcast(tensor, src, stream)`` call, and ``torch.cuda.current_stream()`` (which a
CPU torch cannot answer) is ``None``; ``trainer_init`` is reproduced call for call (the worker's
``init_weight_transfer_engine`` on a thread while rank 0 joins, ``worker_init_payload`` of an
``NCCLWeightTransferInitInfo`` at ``rank_offset=1``, plus ``backend: "gloo"``).  Hostile streams
use the same calls as ``_broadcast_chunk`` (``send``, below) with patches vLLM's checks would stop.

What the new weights must answer: on the reference engine, what a fresh reference engine
loaded with them answers; on the vLLM engine, what the same worker answers after a full load
of them from disk.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
import requests
import torch
import torch.distributed as dist

from tests.helpers import TINY, fresh_output, greedy
from tests.peers.torch_trainer import join_vllm_worker
from tests.peers.vllm_calls import make_vllm_worker
from tests.vllm.servers import VllmProcess, vllm_worker
from tests.vllm.test_vllm import greedy as token_greedy
from tests.vllm.tiny_llama import TinyLlamas
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import WorkerClient, save_checkpoint, weights_digest
from weightsync.trainer.delta import compute_delta

__all__ = ["make_vllm_worker"]

pytestmark = pytest.mark.slow

with warnings.catch_warnings():  # vLLM's model loader imports torch.utils.mkldnn (a deprecated torch.jit API)
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.sparse_nccl_engine import (
        SparseNCCLTrainerWeightTransferEngine,
        SparseWeightPatch,
    )


class GlooComm:
    """``PyNcclCommunicator``'s broadcast, on the process's gloo group."""

    device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        dist.broadcast(tensor, src)

    def destroy(self) -> None:
        """The group is the trainer's to close."""


def changed(base: dict[str, torch.Tensor], fraction: float = 0.01, seed: int = 3) -> dict[str, torch.Tensor]:
    """``base`` with about ``fraction`` of each tensor's elements moved (at least one)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        flat = t.clone().reshape(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] += 0.5
        out[name] = flat.reshape(t.shape)
    return out


def patches_of(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> tuple[list[Any], Any]:
    """vLLM ``SparseWeightPatch`` es from ``base`` to ``target`` (indices shuffled: vLLM promises
    no order), and the delta's manifest (for weightsync's claims)."""
    manifest, payload = compute_delta(base, target)
    out = []
    for t in manifest.changed:
        assert t.indices is not None and t.values is not None
        order = torch.randperm(t.changed, generator=torch.Generator().manual_seed(1))
        idx, values = payload[t.indices].to(torch.int32)[order], payload[t.values][order]
        out.append(SparseWeightPatch(t.name, idx.contiguous(), values.contiguous(), t.shape))
    return out, manifest


def claims(manifest: Any, names: list[str]) -> dict[str, Any]:
    """weightsync's optional extras beside vLLM's ``update_info``."""
    ts = [manifest.tensors[n] for n in names]
    return {
        "base_digest": manifest.base.digest,
        "target_hashes": [t.target_hash for t in ts],
        "base_linear": [list(t.base_linear) for t in ts],
        "target_linear": [list(t.target_linear) for t in ts],
    }


@attrs.define
class Served:
    """The module's vLLM-engine worker, on the tiny Llama ``a``."""

    process: VllmProcess
    models: TinyLlamas
    client: WorkerClient
    digest: str
    names: Iterator[int] = attrs.field(factory=itertools.count)

    @property
    def url(self) -> str:
        return self.process.url

    def load(self, path: Path, version: str) -> None:
        self.client.pause_generation("wait")
        self.client.update_weights_from_disk(str(path), weight_version=version)
        self.client.resume_generation()

    def outputs_of(self, weights: dict[str, torch.Tensor]) -> Any:
        """What this worker answers after a full load of ``weights`` from disk."""
        path = save_checkpoint(weights, self.models.root / f"peers-full-{next(self.names)}")
        self.load(path, "full")
        return token_greedy(self.client)


@pytest.fixture(scope="module")
def vllm_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    models = TinyLlamas.make(tmp_path_factory.mktemp("vllm-peers"))
    process = vllm_worker(models.a, models.root, "--vllm-delta-base", "copy")
    try:
        client = WorkerClient(process.url)
        yield Served(process, models, client, client.get_weight_version()["digest"])
        client.close()
    finally:
        process.stop()


@attrs.frozen
class Worker:
    """The worker under test: its URL, the weights it starts on, its greedy answer, and what
    a worker loaded with given weights answers."""

    url: str
    base: dict[str, torch.Tensor]
    engine: str
    answer: Callable[[], Any]
    outputs_of: Callable[[dict[str, torch.Tensor]], Any]


@pytest.fixture(
    params=["reference", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(1500)])]
)
def worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Worker]:
    if request.param == "reference":
        url = request.getfixturevalue("make_vllm_worker")()
        base = ReferenceEngine(TINY).model.weights()
        yield Worker(url, base, "reference", lambda: greedy(url), lambda w: fresh_output(tmp_path, w))
        return
    served: Served = request.getfixturevalue("vllm_served")
    yield Worker(served.url, served.models.a_tensors, "vllm", lambda: token_greedy(served.client),
                 served.outputs_of)  # fmt: skip
    requests.post(f"{served.url}/shutdown_weight_transfer_engine", timeout=60)
    state = served.client.get_weight_version()
    if state["session_open"]:
        served.client.http.post("/engine/abort_weight_update", json={})
    if state["torn"] or state["digest"] != served.digest:
        served.load(served.models.a, "a")
    served.client.resume_generation()


@pytest.fixture
def joined(worker: Worker) -> Iterator[tuple[str, Any, dict[str, torch.Tensor]]]:
    """A paused worker joined to a gloo trainer as vLLM's ``trainer_init`` does; yields its URL,
    vLLM's HTTP client and the base weights."""
    url = worker.url
    client = HTTPVLLMWeightSyncClient(url, timeout=120)
    assert requests.post(f"{url}/pause", params={"mode": "abort"}, timeout=30).status_code == 200
    trainer = join_vllm_worker(client)
    try:
        yield url, client, worker.base
    finally:
        trainer.close()


def vllm_trainer(client: Any) -> Any:
    engine = SparseNCCLTrainerWeightTransferEngine(client=client)
    engine.model_update_group = GlooComm()
    return engine


def state(url: str) -> dict[str, Any]:
    return dict(requests.post(f"{url}/engine/get_weight_version", json={}, timeout=60).json())


def test_vllms_sparse_trainer_brings_a_worker_to_the_digest_of_a_full_load(
    worker: Worker, joined: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, client, base = joined
    target = changed(base)
    patches, _ = patches_of(base, target)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    vllm_trainer(client).send_weights(patches)
    after = state(url)
    assert after["digest"] == weights_digest(target) and not after["torn"]
    assert after["verified"] is False  # vLLM's trainer claims nothing: read back and rehashed only
    requests.post(f"{url}/resume", timeout=30)
    assert worker.answer() == worker.outputs_of(target)


def test_with_weightsync_claims_the_sparse_delta_is_verified(
    joined: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _client, base = joined
    target = changed(base, seed=4)
    patches, manifest = patches_of(base, target)

    class Claiming(HTTPVLLMWeightSyncClient):  # type: ignore[misc]
        def update_weights(self, update_info: Any) -> None:
            super().update_weights({**update_info, **claims(manifest, update_info["names"])})

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    vllm_trainer(Claiming(url, timeout=120)).send_weights(patches)
    after = state(url)
    assert after["digest"] == weights_digest(target) == manifest.target.digest
    assert after["verified"] is True and not after["torn"]


def send(url: str, info: dict[str, Any], tensors: list[torch.Tensor]) -> requests.Response:
    """``_broadcast_chunk``'s calls: ``update_weights`` on a thread, then the broadcasts."""
    requests.post(f"{url}/start_weight_update", timeout=30)
    with ThreadPoolExecutor(1) as exe:
        posted = exe.submit(requests.post, f"{url}/update_weights", json={"update_info": info}, timeout=120)
        for t in tensors:
            dist.broadcast(t.contiguous(), 0)
        return posted.result(timeout=120)


def one_patch(
    base: dict[str, torch.Tensor], n: int = 40
) -> tuple[str, torch.Tensor, torch.Tensor, dict[str, Any]]:
    name = "model.layers.0.self_attn.q_proj.weight"
    t = base[name]
    idx = torch.arange(0, 2 * n, 2, dtype=torch.int32)
    values = t.reshape(-1)[idx.long()] + 1.0
    info = {"names": [name], "dtype_names": ["float32"], "shapes": [list(t.shape)], "num_updates_list": [n]}
    return name, idx, values, info


@pytest.mark.parametrize("lie", ["out_of_range", "duplicate", "nan", "fewer_values"])
def test_a_hostile_sparse_stream_is_refused_and_nothing_changes(joined: Any, lie: str) -> None:
    url, _client, base = joined
    before = state(url)
    name, idx, values, info = one_patch(base)
    if lie == "out_of_range":
        idx[-1] = base[name].numel()
    elif lie == "duplicate":
        idx[5] = idx[9]
    elif lie == "nan":
        values[3] = float("nan")
    else:
        values = values[:-4]  # 16 bytes short
    reply = send(url, info, [idx, values])
    assert reply.status_code == 400, reply.text
    expected = {"fewer_values": "short_send"}.get(lie, "bad_delta")
    assert reply.json()["error"]["type"] == expected
    after = state(url)
    assert after["digest"] == before["digest"] and not after["torn"]


@pytest.mark.parametrize("lie", ["one_value_short", "wrong_target"])
def test_a_claimed_delta_that_does_not_verify_is_undone_or_refused(
    worker: Worker, joined: Any, lie: str
) -> None:
    """The reference engine wrote the tensor in place and puts it back; the vLLM engine checks
    the patched copy before vLLM sees it, so nothing was written."""
    url, _client, base = joined
    before = state(url)
    name, idx, values, info = one_patch(base)
    target = dict(base)
    flat = base[name].clone().reshape(-1)
    flat[idx.long()] = values
    target[name] = flat.reshape(base[name].shape)
    manifest, _ = compute_delta(base, target)
    info |= claims(manifest, [name])
    if lie == "one_value_short":
        values = values[:-1]  # 4 bytes short: below the receiver's sentinel, caught by the claims
    else:  # a target the values do not make: both its hash and its linear digest
        info["target_linear"] = [[1, 2]]
        info["target_hashes"] = ["0123456789abcdef"]
    reply = send(url, info, [idx, values])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "delta_unverified"
    assert ("put back" in error["message"]) is (worker.engine == "reference"), error
    after = state(url)
    assert after["digest"] == before["digest"] and not after["torn"]


def test_a_delta_for_another_base_is_409_before_any_collective(joined: Any) -> None:
    url, _client, base = joined
    before = state(url)
    _name, _idx, _values, info = one_patch(base)
    info |= {
        "base_digest": "0" * 32,
        "target_hashes": ["0" * 16],
        "base_linear": [[0, 0]],
        "target_linear": [[0, 0]],
    }
    requests.post(f"{url}/start_weight_update", timeout=30)
    reply = requests.post(f"{url}/update_weights", json={"update_info": info}, timeout=60)
    assert reply.status_code == 409, reply.text
    assert reply.json()["error"]["type"] == "base_mismatch"
    assert state(url)["digest"] == before["digest"]
