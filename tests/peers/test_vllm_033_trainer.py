"""vLLM 0.33's stock trainer against a weightsync worker, twice in a row: its second update sends
``names``, ``dtype_names`` and ``shapes`` empty, meaning "the previous call's".

``NCCLTrainerWeightTransferEngine.send_weights`` of vLLM 0.33.0
(``vllm/distributed/weight_transfer/nccl_engine.py``) is reproduced call for call below
(:class:`Vllm033Trainer`): ``meta = source.metadata`` (a ``cached_property`` in 0.33), an empty
``NCCLWeightTransferUpdateInfo()`` when ``meta == self._sent_meta``, ``start_weight_update``,
``update_weights`` on a thread beside the per-tensor broadcast (``packed=False``), then
``finish_weight_update`` and ``self._sent_meta = meta``.  Its ``PyNcclCommunicator`` is a gloo
group on CPU (:class:`~tests.peers.torch_trainer.PlainTrainer`), and vLLM's own
``HTTPVLLMWeightSyncClient`` carries the calls.  The worker side is what vLLM 0.33's
``NCCLWeightTransferEngine.receive_weights`` does with empty lists: the last call's metadata.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import pytest
import requests
import torch
import torch.distributed as dist

from tests.helpers import TINY, perturbed
from tests.peers.torch_trainer import PlainTrainer, join_vllm_worker
from tests.peers.vllm_calls import make_vllm_worker
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import weights_digest

with warnings.catch_warnings():  # vLLM's model loader imports torch.utils.mkldnn (a deprecated torch.jit API)
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

__all__ = ["make_vllm_worker"]

pytestmark = pytest.mark.slow


@dataclass
class NCCLWeightTransferUpdateInfo:
    """0.33's update info: the three lists default to empty ("reuse the previous call's")."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class Source:
    """0.33's ``WeightSource`` shape: ``metadata`` a property, ``iter_full()`` the pairs."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    @property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()


class Vllm033Trainer:
    """``NCCLTrainerWeightTransferEngine`` (0.33) on the sender, ``packed=False``."""

    def __init__(self, client: Any, source: Source) -> None:
        self.client = client
        self.source = source
        self._sent_meta: list[ParamMeta] | None = None

    def send_weights(self) -> None:
        source = self.source
        meta = source.metadata
        if meta == self._sent_meta:
            update_info = NCCLWeightTransferUpdateInfo()
        else:
            update_info = NCCLWeightTransferUpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                shapes=[list(m.shape) for m in meta],
            )
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, asdict(update_info))
            if future.done():
                future.result()
            for _name, tensor in source.iter_full():  # _broadcast, one by one
                dist.broadcast(tensor if tensor.is_contiguous() else tensor.contiguous(), 0)
            future.result()
        finally:
            exe.shutdown(wait=False)
        self.client.finish_weight_update()
        self._sent_meta = meta


def state(url: str) -> dict[str, Any]:
    return dict(requests.post(f"{url}/engine/get_weight_version", json={}, timeout=60).json())


def join(url: str) -> tuple[Any, PlainTrainer]:
    """The worker paused and joined to a gloo rank 0, as 0.33's ``trainer_init`` does
    (``packed=False``: one broadcast per tensor)."""
    client = HTTPVLLMWeightSyncClient(url, timeout=120)
    assert requests.post(f"{url}/pause", params={"mode": "abort"}, timeout=30).status_code == 200
    return client, join_vllm_worker(client, packed=False)


def test_vllm_033s_trainer_updates_twice_the_second_time_with_empty_lists(make_vllm_worker: Any) -> None:
    url = make_vllm_worker(dialect="vllm")
    client, trainer = join(url)
    try:
        base = dict(ReferenceEngine(TINY).model.weights())
        engine = Vllm033Trainer(client, Source(perturbed(base, seed=1)))
        engine.send_weights()
        first = state(url)
        assert first["digest"] == weights_digest(engine.source.weights) and not first["torn"]
        engine.source = Source(perturbed(base, seed=2))  # the same parameters, new values
        sent: list[dict[str, Any]] = []
        original = client.update_weights
        client.update_weights = lambda info: (sent.append(info), original(info))[1]
        engine.send_weights()
        assert sent == [{"names": [], "dtype_names": [], "shapes": []}]  # what 0.33 sends the second time
        second = state(url)
        assert second["digest"] == weights_digest(engine.source.weights) != first["digest"]
        assert not second["torn"] and not second["session_open"]
    finally:
        trainer.close()


def test_empty_lists_on_a_fresh_group_are_refused_and_the_trainer_is_not_left_waiting(
    make_vllm_worker: Any,
) -> None:
    """A first update with empty lists has no previous metadata: a 400 naming it, the group shut
    down so that the trainer's broadcast fails rather than waiting for a receiver, and the
    worker's weights and state unchanged."""
    url = make_vllm_worker(dialect="vllm")
    before = state(url)
    _client, trainer = join(url)
    try:
        requests.post(f"{url}/start_weight_update", json={}, timeout=30).raise_for_status()
        t0 = time.monotonic()
        reply = requests.post(
            f"{url}/update_weights", json={"update_info": asdict(NCCLWeightTransferUpdateInfo())}, timeout=60
        )
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "no_previous_metadata"
        with pytest.raises(RuntimeError):  # the trainer's collective returns: its peer left the group
            for _ in range(50):
                dist.broadcast(torch.zeros(1 << 16), 0)
        assert time.monotonic() - t0 < 60
        requests.post(f"{url}/finish_weight_update", timeout=30)
        after = state(url)
        assert after["digest"] == before["digest"] and not after["torn"]
    finally:
        trainer.close()
