"""Tensor transport: a colocated worker reads tensors from shared memory (:mod:`.shm`; the
trainer side is :func:`weightsync.trainer.share_tensors`)."""

from __future__ import annotations

__all__: list[str] = []
