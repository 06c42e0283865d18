"""A ``weightsync`` backend for vLLM's weight-transfer factories (trainer side).

vLLM's trainer flow builds a ``TrainerWeightTransferEngine`` from an init info whose
``backend`` names it, hands it a ``VLLMWeightSyncClient`` (``HTTPVLLMWeightSyncClient`` over
HTTP) and a ``WeightSource``, and calls ``send_weights()`` each round.  :func:`register` adds
``"weightsync"`` to ``WeightTransferTrainerFactory``; its engine sends weightsync's packed,
checksummed stream (a manifest in the group's store before the first collective, the
xxh3-64 of every tensor after the last) over torch.distributed — gloo on CPU, NCCL on GPU —
to a weightsync worker, whose vLLM dialect receives it inside an update session::

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from weightsync.trainer.vllm_backend import WeightSyncTrainerInitInfo, register

    register()
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(master_address="127.0.0.1", master_port=29600, world_size=2, rank=0),
        client=HTTPVLLMWeightSyncClient("http://worker:8000"),
        source=ModuleSource(model),
    )
    engine.send_weights()   # start_weight_update, update_weights (+ the stream), finish_weight_update

The worker must be paused (``POST /pause``) first: weightsync refuses to change weights under
running requests.  Importing this module needs vLLM.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from weightsync.core.errors import EngineFailure
from weightsync.core.snapshot import TensorSpec
from weightsync.trainer.broadcast import Broadcaster
from weightsync.transports.distributed.group import Group, create_group
from weightsync.transports.distributed.keys import manifest_key, ready_key
from weightsync.transports.distributed.layout import DEFAULT_BUCKET_BYTES, manifest, plan_chunks

BACKEND = "weightsync"


@dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``weightsync`` backend: the group's rendezvous (the
    sender hosts the TCPStore at ``master_address:master_port`` as rank 0; workers start at
    rank 1), the torch.distributed ``transport`` (``gloo`` on CPU, ``nccl`` on GPU), the
    bucket size of the packed stream, and how long any step may take."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    transport: str = "gloo"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 60.0


class WeightSyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """Rank 0 of the weight-update group; sends weightsync's packed stream each round."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool,
        info: WeightSyncTrainerInitInfo,
    ) -> None:
        rank = {"rank": info.rank} if _TAKES_RANK else {}  # vLLM 0.33's engines know their rank
        super().__init__(client=client, source=source, is_sender=is_sender, **rank)
        self.info = info
        self.group: Group | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: WeightSyncTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> WeightSyncTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the weightsync backend needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if not engine.is_sender:
            return engine
        info = init_info
        store = dist.TCPStore(
            info.master_address,
            info.master_port,
            None,
            True,
            datetime.timedelta(seconds=info.timeout_s),
            wait_for_workers=False,
        )
        worker_info = {
            "master_address": info.master_address,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": info.world_size,
            "backend": info.transport,
            "stream": BACKEND,
            "timeout_s": info.timeout_s,
        }
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, worker_info)
            engine.group = create_group(
                "vllm",
                master_address=info.master_address,
                master_port=store.port,
                rank=0,
                world_size=info.world_size,
                backend=info.transport,
                timeout_s=info.timeout_s,
                store=store,
            )
            joined.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = source_metadata(self.source)
        if not self.is_sender:
            for _ in source_pairs(self.source):  # stay in the trainer-side gather
                pass
            return
        group = self.group
        if group is None:
            raise EngineFailure("not initialised: trainer_init first", code="not_connected")
        specs = [TensorSpec(m.name, str(m.dtype).removeprefix("torch."), tuple(m.shape)) for m in meta]
        items = [(name, tensor.detach()) for name, tensor in source_pairs(self.source)]
        stream_id = uuid.uuid4().hex
        chunks = plan_chunks(specs, self.info.bucket_bytes)
        group.store.set(manifest_key(stream_id), manifest(chunks))
        update_info = {
            "names": [s.name for s in specs],
            "dtype_names": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs],
            "packing": {"bucket_bytes": self.info.bucket_bytes, "stream_id": stream_id},
        }
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(1)
        try:
            posted = pool.submit(self.client.update_weights, update_info)
            go = self._wait_ready(group, stream_id, posted)
            Broadcaster._send(_SENDER, group, items, chunks, go, stream_id)
            posted.result()  # the worker's refusal, if it refused
        finally:
            pool.shutdown(wait=False)
        self.client.finish_weight_update()

    def _wait_ready(self, group: Group, stream_id: str, posted: Any) -> bool:
        keys = [ready_key(stream_id, r) for r in range(1, group.world_size)]
        deadline = time.monotonic() + self.info.timeout_s
        while not posted.done() and time.monotonic() < deadline:
            if group.store.check(keys):
                return True
            time.sleep(0.002)
        return False

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def source_metadata(source: WeightSource) -> list[Any]:
    """A ``WeightSource``'s parameters' metadata: a method up to vLLM 0.32, a
    ``functools.cached_property`` from 0.33."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def source_pairs(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """A ``WeightSource``'s ``(name, full tensor)`` pairs: iterating the source up to vLLM
    0.32, ``iter_full()`` (which gathers a sharded parameter among its owners) from 0.33."""
    iter_full = getattr(source, "iter_full", None)
    return iter_full() if callable(iter_full) else iter(source)  # type: ignore[call-overload, no-any-return]


_TAKES_RANK = "rank" in inspect.signature(TrainerWeightTransferEngine.__init__).parameters
"""Whether this vLLM's trainer engines take their ``rank`` (0.33 and later)."""

_SENDER = Broadcaster([], backend="gloo")
"""Sends a stream the same way every weightsync trainer does (``Broadcaster._send``)."""


def register() -> None:
    """Add the ``weightsync`` backend to vLLM's factories (idempotent): this trainer-side
    engine, and the engine side (``weightsync.engines.vllm.transfer``, loaded lazily by
    vLLM's workers when their ``--weight-transfer-config`` names the backend)."""
    with contextlib.suppress(ValueError):  # already registered
        WeightTransferTrainerFactory.register_engine(BACKEND, WeightSyncTrainerWeightTransferEngine)
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND, "weightsync.engines.vllm.transfer", "WeightSyncWeightTransferEngine"
        )
