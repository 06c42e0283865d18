"""How a weight stream is laid out: a sequence of chunks, each one collective.

Tensors of at least ``DIRECT_BYTES`` travel alone, straight from the trainer's tensor into
the engine's (no packing copy on either side when dtypes and devices agree); smaller ones
are packed, in order, into buckets of at most ``bucket_bytes``.  Trainer and worker compute
the same layout from the same metadata, so nothing else has to be agreed on.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import attrs

from weightsync.core.dtypes import itemsize
from weightsync.core.snapshot import TensorSpec

ALIGN = 64
DIRECT_BYTES = 4 << 20
DEFAULT_BUCKET_BYTES = 32 << 20
"""Chosen by measurement (benchmarks/broadcast.py --sweep): larger buckets amortise each
collective's fixed cost, and two of them must fit in memory on both sides."""
STREAM_DEPTH = 4
"""Collectives in flight at once on either side.  Two bucket buffers are all the memory a
stream holds (a buffer is refilled only once its previous collective is done), so the depth
beyond two is tensors sent alone: the wire keeps running while a side packs or unpacks."""


def nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * itemsize(spec.dtype)


@attrs.frozen
class Slot:
    spec: TensorSpec
    offset: int
    nbytes: int


@attrs.frozen
class Bucket:
    """Several tensors packed into one byte buffer of ``size`` bytes."""

    size: int
    slots: tuple[Slot, ...]


@attrs.frozen
class Direct:
    """One large tensor sent as it is."""

    spec: TensorSpec
    nbytes: int


Chunk = Bucket | Direct


def plan_chunks(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Chunk]:
    """Lay ``specs`` out in order: large tensors alone, the rest packed (64-byte aligned)."""
    chunks: list[Chunk] = []
    slots: list[Slot] = []
    used = 0
    for spec in specs:
        n = nbytes(spec)
        if n >= min(DIRECT_BYTES, bucket_bytes):
            chunks.append(Direct(spec, n))
            continue
        start = -(-used // ALIGN) * ALIGN
        if slots and start + n > bucket_bytes:
            chunks.append(Bucket(used, tuple(slots)))
            slots, start = [], 0
        slots.append(Slot(spec, start, n))
        used = start + n
        if used >= bucket_bytes:
            chunks.append(Bucket(used, tuple(slots)))
            slots, used = [], 0
    if slots:
        chunks.append(Bucket(used, tuple(slots)))
    return chunks


def bucket_capacity(chunks: Sequence[Chunk]) -> int:
    return max((c.size for c in chunks if isinstance(c, Bucket)), default=0)


def manifest(chunks: Sequence[Chunk]) -> bytes:
    """The byte count of every chunk, in order (little-endian u64s): what the trainer says it
    will send, so that a worker compares it with its own plan before receiving anything."""
    return struct.pack(f"<{len(chunks)}Q", *(c.size if isinstance(c, Bucket) else c.nbytes for c in chunks))


def flat_chunks(specs: Sequence[TensorSpec], flat_bucket_bytes: int | None) -> list[list[TensorSpec]]:
    """The tensors of each flat broadcast, in order: vLLM's rule (a chunk closes after the
    tensor that takes it past ``flat_bucket_bytes``), or everything in one without a size."""
    if flat_bucket_bytes is None:
        return [list(specs)]
    chunks: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        chunks[-1].append(spec)
        size += nbytes(spec)
        if size > flat_bucket_bytes:
            chunks.append([])
            size = 0
    return [c for c in chunks if c]
