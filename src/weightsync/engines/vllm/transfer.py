"""The ``weightsync`` backend on vLLM's engine side (``WeightTransferEngineFactory``).

For a vLLM server that keeps its own RL routes (``--weight-transfer-config
'{"backend": "weightsync"}'`` after :func:`register`), this engine receives weightsync's
packed, checksummed stream inside each vLLM worker: ``init_transfer_engine`` joins the
trainer's group (the ``init_info`` the trainer-side backend sends), ``receive_weights``
validates the update's metadata against the model, checks the trainer's manifest before the
first collective, streams the tensors into ``model.load_weights`` and fails the update when
their xxh3-64 hashes differ from the trainer's.  The weightsync middleware is the other way
to serve vLLM: there weightsync answers vLLM's routes itself, with its full state machine.

vLLM builds the engine in each worker with ``WeightTransferEngineFactory.create_engine``, by
the backend's name, so the name must be registered in the worker process before its model
loads: name :class:`~weightsync.engines.vllm.transfer_extension.WeightSyncTransferExtension`
as the server's ``--worker-extension-cls`` (vLLM imports it in every worker first, and its
module calls :func:`register`)::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "weightsync"}' \\
        --worker-extension-cls weightsync.engines.vllm.transfer_extension.WeightSyncTransferExtension
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from weightsync.core.requests import InitGroupRequest
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DistributedSource
from weightsync.engines.vllm.layerwise import end_unfinished_reload
from weightsync.transports.distributed.worker import GroupRegistry
from weightsync.transports.sink import PullTarget, pull

GROUP = "vllm"


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    stream: str = "weightsync"
    timeout_s: float = 60.0


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packing: dict[str, Any]


class WeightSyncWeightTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups = GroupRegistry()
        self.received: dict[str, str] = {}
        """The xxh3-64 of every tensor the last update received and handed to the model."""

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        rank = self.parallel_config.rank
        request = InitGroupRequest(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset,
            init_info.world_size,
            GROUP,
            init_info.backend,
            init_info.timeout_s,
        )
        self.groups.join(request, local_rank=rank)

    def start_weight_update(self) -> None:
        """Checkpoint-format weights go through vLLM's layerwise reload, as for its stock
        ``nccl`` backend: a loaded model's parameters may be processed into another form
        (on CPU, packed), so ``load_weights`` alone cannot write them."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # vLLM drops a failed update without finish_weight_update: a layer it left half
        # loaded would otherwise skip this initialisation and be processed incomplete.
        end_unfinished_reload(self.model, self.model_config)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Process the reloaded weights into the model's serving form; the stream was
        verified before ``receive_weights`` returned."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        try:
            self._receive(update_info)
        except BaseException:
            # vLLM ends a failed session without finish_weight_update: end the reload here,
            # so no layer stays on the meta device or keeps a partial count for the next one.
            with contextlib.suppress(Exception):
                end_unfinished_reload(self.model, self.model_config)
            raise

    def _receive(self, update_info: WeightSyncUpdateInfo) -> None:
        source = DistributedSource(
            GROUP,
            [
                TensorSpec(n, d, tuple(s))
                for n, d, s in zip(
                    update_info.names, update_info.dtype_names, update_info.shapes, strict=True
                )
            ],
            bucket_bytes=int(update_info.packing["bucket_bytes"]),
            stream_id=str(update_info.packing["stream_id"]),
        )
        reader = self.groups.reader(source)
        # Checkpoint names, not vLLM's fused parameters: the model's load_weights maps them
        # (and refuses unknown ones); the reader checks the group and the trainer's manifest.
        reader.validate({t.name: t for t in source.tensors})
        target = PullTarget()
        self.received = {}
        self.model.load_weights(pull(reader.stream(target), target))
        self.received = dict(target.hashes)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.groups.close()


def register() -> None:
    """Add the ``weightsync`` backend to vLLM's engine-side factory (idempotent)."""
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine("weightsync", WeightSyncWeightTransferEngine)
