"""Trainer side of the tensor channel: copy tensors once into a shared-memory segment.

A colocated trainer calls :func:`share_tensors` and posts ``.tensors`` as the body of
``update_weights_from_tensor``; the worker reads them with
:mod:`weightsync.transports.tensor.shm`, which owns the segment-name and alignment rules
used here.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from multiprocessing import shared_memory
from typing import Any

import torch

from weightsync.transports.sink import dtype_name
from weightsync.transports.tensor.shm import PREFIX

__all__ = ["SharedTensors", "share_tensors"]

ALIGN = 64
"""Each tensor starts at a multiple of this many bytes, so a view of any dtype is aligned."""


class SharedTensors:
    """Tensors copied into one shared-memory segment, and the handles that describe them.

    Keep it alive until the update returns; ``close()`` (or ``with``) unlinks the segment.
    """

    def __init__(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(named.items() if isinstance(named, Mapping) else named)
        offsets, used = [], 0
        for _, t in items:
            used = -(-used // ALIGN) * ALIGN
            offsets.append(used)
            used += t.numel() * t.element_size()
        self.shm = shared_memory.SharedMemory(
            create=True, size=max(used, 1), name=PREFIX + secrets.token_hex(8)
        )
        self.tensors: list[dict[str, Any]] = []
        for (name, t), off in zip(items, offsets, strict=True):
            n = t.numel() * t.element_size()
            dst = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=n, offset=off) if n else None
            if dst is not None:
                dst.copy_(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
                del dst
            self.tensors.append(
                {
                    "name": name,
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "handle": {"shm": self.shm.name, "offset": off},
                }
            )

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_tensors(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> SharedTensors:
    """Copy ``named`` into shared memory; post ``.tensors`` as ``update_weights_from_tensor``'s body."""
    return SharedTensors(named)
