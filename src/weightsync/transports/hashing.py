"""The one way weightsync hashes a tensor: xxh3-64 of its raw bytes (dtype and shape
excluded), lowercase hex.  Equal hashes, equal weights.

Every channel hashes with these functions (a streaming :func:`hasher` where bytes arrive in
chunks), the trainer hashes what it sends and writes with them, and the digest of a worker
(:func:`weightsync.core.held.weights_digest`) combines them, so a hash taken on one side
always compares with one taken on the other.  The trainer may import this module; it
imports nothing above the core.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xxhash


def hasher() -> xxhash.xxh3_64:
    """A fresh streaming hasher (feed it a tensor's bytes in order, in any chunks)."""
    return xxhash.xxh3_64()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor``, in memory order: a view of its own memory when it is a
    contiguous CPU tensor, else of a contiguous CPU copy."""
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().data


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """The 8-byte xxh3-64 of ``tensor``'s bytes (:func:`tensor_hash` in binary form)."""
    return xxhash.xxh3_64_digest(tensor_bytes(tensor))


def tensor_hash(tensor: torch.Tensor) -> str:
    """xxh3-64 of ``tensor``'s bytes, lowercase hex."""
    return xxhash.xxh3_64_hexdigest(tensor_bytes(tensor))


def tensor_hashes(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``name -> tensor_hash`` of every pair."""
    return {name: tensor_hash(t) for name, t in named}
