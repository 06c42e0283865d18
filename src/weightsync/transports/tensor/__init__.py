"""Tensor transport: a colocated worker reads tensors from shared memory (the trainer side is
:func:`weightsync.trainer.share_tensors`).  Names load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_exports

if TYPE_CHECKING:
    from weightsync.trainer.share import SharedTensors, share_tensors

_WHERE = {
    "SharedTensors": "weightsync.trainer.share",
    "share_tensors": "weightsync.trainer.share",
}
__all__ = [
    "SharedTensors", "share_tensors",
]  # fmt: skip
__getattr__ = lazy_exports(__name__, _WHERE)
