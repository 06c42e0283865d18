"""The trainer's side of weightsync: what runs in the training process, not in a worker.

- :func:`save_checkpoint` writes an atomic safetensors checkpoint for ``update_weights_from_disk``;
- :class:`Broadcaster` is rank 0 of a weight-update group and pushes tensors to many workers;
- :func:`share_tensors` copies tensors into shared memory for a colocated worker;
- :class:`WorkerClient`, :class:`AsyncWorkerClient` drive one worker's admin routes, and
  :class:`Fleet` drives many at once;
- :class:`DeltaTrainer` (and :func:`compute_delta`, :func:`save_delta`) writes delta checkpoints
  against the version a fleet last committed, for ``update_weights_from_delta``;
- :func:`weights_digest` is the digest a worker holding exactly the given tensors reports;
- :func:`save_adapter` writes a LoRA adapter in PEFT's layout with a manifest, and
  :func:`adapter_digest` is the digest a worker holding it reports.

Names load on first use, so importing this package costs nothing until one is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_dir, lazy_exports

if TYPE_CHECKING:
    from weightsync.trainer.adapter import adapter_digest, save_adapter
    from weightsync.trainer.broadcast import Broadcaster, PushFailed
    from weightsync.trainer.checkpoint import save_checkpoint
    from weightsync.trainer.client import AsyncWorkerClient, WorkerClient, raise_for_reply
    from weightsync.trainer.delta import DeltaTrainer, compute_delta, save_delta
    from weightsync.trainer.digest import weights_digest
    from weightsync.trainer.fleet import Fleet, FleetError
    from weightsync.trainer.share import SharedTensors, share_tensors

_WHERE = {
    "Broadcaster": ".broadcast", "PushFailed": ".broadcast", "save_checkpoint": ".checkpoint",
    "AsyncWorkerClient": ".client", "WorkerClient": ".client", "raise_for_reply": ".client",
    "Fleet": ".fleet", "FleetError": ".fleet", "SharedTensors": ".share", "share_tensors": ".share",
    "weights_digest": ".digest", "DeltaTrainer": ".delta", "compute_delta": ".delta", "save_delta": ".delta",
    "adapter_digest": ".adapter", "save_adapter": ".adapter",
}  # fmt: skip
__all__ = [
    "AsyncWorkerClient",
    "Broadcaster",
    "DeltaTrainer",
    "Fleet",
    "FleetError",
    "PushFailed",
    "SharedTensors",
    "WorkerClient",
    "adapter_digest",
    "compute_delta",
    "raise_for_reply",
    "save_adapter",
    "save_checkpoint",
    "save_delta",
    "share_tensors",
    "weights_digest",
]  # fmt: skip
__getattr__ = lazy_exports(__name__, _WHERE)
__dir__ = lazy_dir(globals(), __all__)
