"""The trainer a vLLM-dialect worker meets on ``backend: "gloo"``: rank 0 of a plain
``torch.distributed.init_process_group("gloo", init_method="tcp://…")``, torch's default group,
with no weightsync code on the trainer's side (vLLM's own trainer needs NCCL; on gloo this is
what a trainer writes).  The group is the process's default group, so one trainer at a time;
:meth:`PlainTrainer.close` destroys it."""

from __future__ import annotations

import datetime
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers import free_port


class PlainTrainer:
    """Rank 0 joining ``tcp://127.0.0.1:<port>`` (on a thread) as soon as it is made; the
    worker joins through its init route."""

    def __init__(self, world_size: int = 2, port: int | None = None) -> None:
        self.port = port or free_port()
        self.world_size = world_size
        self.pool = ThreadPoolExecutor(2)
        self.joining: Future[None] = self.pool.submit(
            dist.init_process_group,
            "gloo",
            init_method=f"tcp://127.0.0.1:{self.port}",
            rank=0,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )

    def init_info(self, **extra: Any) -> dict[str, Any]:
        """vLLM's ``init_info`` for this group, on gloo."""
        return {
            "master_address": "127.0.0.1", "master_port": self.port, "rank_offset": 1,
            "world_size": self.world_size, "backend": "gloo", **extra,
        }  # fmt: skip

    def joined(self) -> None:
        self.joining.result(timeout=300)

    def ready(self) -> Future[PlainTrainer]:
        """This trainer, once its group is formed."""
        return self.pool.submit(lambda: (self.joined(), self)[1])

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start ``dist.broadcast(tensor, src=0, async_op=True)`` on the default group; returns
        the work (as weightsync's ``Group.broadcast`` does, so :meth:`wait` takes it)."""
        self.joined()
        return dist.broadcast(tensor.contiguous(), 0, async_op=True)

    def wait(self, work: Any) -> None:
        work.wait()

    def close(self) -> None:
        if self.joining.done() and self.joining.exception() is None:
            dist.destroy_process_group()
        self.pool.shutdown(wait=False, cancel_futures=True)


def join_vllm_worker(client: Any, **init: Any) -> PlainTrainer:
    """A worker joined to a gloo rank 0 as vLLM's ``trainer_init`` does: the worker's
    ``init_weight_transfer_engine`` (``worker_init_payload`` of an ``NCCLWeightTransferInitInfo``
    at ``rank_offset=1``, plus ``backend: "gloo"`` and ``init``) on a thread while rank 0 joins.
    ``client`` is vLLM's ``HTTPVLLMWeightSyncClient``; the caller closes the trainer."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    trainer = PlainTrainer(2)
    info = NCCLWeightTransferInitInfo(
        master_address="127.0.0.1", master_port=trainer.port, rank_offset=1, world_size=2
    )
    with ThreadPoolExecutor(1) as exe:
        future = exe.submit(
            client.init_weight_transfer_engine, {**worker_init_payload(info), "backend": "gloo", **init}
        )
        trainer.joined()
        future.result(timeout=120)
    return trainer
