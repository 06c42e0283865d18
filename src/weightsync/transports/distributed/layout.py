"""How a weight stream is packed: tensors, in order, into fixed-size byte buckets.

Trainer and worker compute the same layout from the same metadata (names, dtypes, shapes,
bucket size), so nothing but the metadata has to be agreed on.  A tensor larger than a
bucket travels alone in a bucket of its own size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from weightsync.core.values import TensorSpec

from ..disk.format import DTYPES

ALIGN = 64
ITEMSIZE = {name: size for name, size in DTYPES.values()} | {"complex64": 8, "complex128": 16}

DEFAULT_BUCKET_BYTES = 256 << 20
"""Chosen by measurement (benchmarks/broadcast.py --sweep): larger buckets amortise each
collective's fixed cost, and two of them must fit in memory on both sides."""


def nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * ITEMSIZE[spec.dtype]


@attrs.frozen
class Slot:
    spec: TensorSpec
    offset: int
    nbytes: int


@attrs.frozen
class Bucket:
    size: int
    slots: tuple[Slot, ...]


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Pack ``specs`` in order into buckets of at most ``bucket_bytes`` (64-byte aligned)."""
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0
    for spec in specs:
        n = nbytes(spec)
        start = -(-used // ALIGN) * ALIGN
        if slots and start + n > bucket_bytes:
            buckets.append(Bucket(used, tuple(slots)))
            slots, start = [], 0
        slots.append(Slot(spec, start, n))
        used = start + n
    if slots:
        buckets.append(Bucket(used, tuple(slots)))
    return buckets
