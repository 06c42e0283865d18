"""Boxes: the slices of a tensor that layouts and plans speak of.

A slice of a tensor is a :class:`Box`: one half-open interval ``[start, stop)`` per
dimension, in the coordinates of the *full* tensor.  A TP shard on dimension 1 of a
``[4096, 11008]`` weight is ``Box(((0, 4096), (0, 5504)))``; it is not one contiguous byte
range of the full tensor but 4096 of them (one per dim-0 index).  Every range in a layout or
a plan is therefore a box, and its bytes are defined as the box's elements in row-major (C)
order: that is the order they travel in on the wire, and the order in which
:meth:`Box.runs` lists the exact byte ranges of the full tensor they come from.  A box
restricted on dim 0 only is one contiguous byte range.  Pure Python: no torch.

The JSON checks every layout and plan wire form shares: one error (``InvalidRequest``,
``invalid_layout``), readers of integers, objects and lists that raise it, the bounds they
enforce, and the wire form of a :class:`~weightsync.core.snapshot.TensorSpec`.  Pure Python.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, Final

import attrs

from weightsync.core.dtypes import DTYPES, itemsize
from weightsync.core.errors import InvalidRequest
from weightsync.core.snapshot import TensorSpec

MAX_RANKS: Final = 65536
MAX_TENSORS: Final = 1 << 20
MAX_DIMS: Final = 16


def bad_layout(message: str, field: str | None = None) -> InvalidRequest:
    """The ``InvalidRequest`` (``invalid_layout``) for a malformed layout or plan."""
    extra = {"field": field} if field else {}
    return InvalidRequest(message, code="invalid_layout", **extra)


def wire_int(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``value`` as an integer in ``[lo, hi]``.  Raises ``InvalidRequest`` (``invalid_layout``)."""
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bound = f" and at most {hi}" if hi is not None else ""
        raise bad_layout(f"{what} must be an integer of at least {lo}{bound}, got {value!r}", what)
    return value


def spec_to_wire(spec: TensorSpec) -> dict[str, Any]:
    """The JSON object of ``spec``: name, dtype and shape."""
    return {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)}


def spec_from_wire(value: Any, what: str) -> TensorSpec:
    """The spec ``value`` names (other keys are the caller's to check).  Raises
    ``InvalidRequest`` (``invalid_layout``)."""
    if not isinstance(value, dict):
        raise bad_layout(f"{what} must be an object", what)
    name, dtype, shape = value.get("name"), value.get("dtype"), value.get("shape")
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise bad_layout(f"{what}.name must be a non-empty string of at most 1024 characters", what)
    if dtype not in DTYPES:
        raise bad_layout(f"{what}.dtype {dtype!r} is not a known dtype", what)
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise bad_layout(f"{what}.shape must be a list of at most {MAX_DIMS} sizes", what)
    return TensorSpec(name, str(dtype), tuple(wire_int(n, f"{what}.shape", 0, 1 << 48) for n in shape))


def wire_object(value: Any, keys: set[str], what: str) -> dict[str, Any]:
    """``value`` as an object with no keys beyond ``keys``.  Raises ``InvalidRequest``
    (``invalid_layout``)."""
    if not isinstance(value, dict):
        raise bad_layout(f"{what} must be an object", what)
    unknown = set(value) - keys
    if unknown:
        raise bad_layout(f"{what} has unknown fields {sorted(unknown)}", what)
    return value


def wire_list(value: Any, what: str, limit: int) -> list[Any]:
    """``value`` as a list of at most ``limit`` entries.  Raises ``InvalidRequest``
    (``invalid_layout``)."""
    if not isinstance(value, list) or len(value) > limit:
        raise bad_layout(f"{what} must be a list of at most {limit} entries", what)
    return value


def wire_ints(value: Any, what: str, lo: int, hi: int, limit: int) -> list[int]:
    """``value`` as a list of at most ``limit`` integers, each in ``[lo, hi]`` (a ``true`` or
    ``1.0`` is not an integer).  Raises ``InvalidRequest`` (``invalid_layout``)."""
    if not isinstance(value, list) or len(value) > limit:
        raise bad_layout(f"{what} must be a list of at most {limit} integers", what)
    if value and (not set(map(type, value)) <= {int} or min(value) < lo or max(value) > hi):
        i, bad = next((i, x) for i, x in enumerate(value) if type(x) is not int or not lo <= x <= hi)
        raise bad_layout(
            f"{what}[{i}] must be an integer of at least {lo} and at most {hi}, got {bad!r}", what
        )
    return value


@attrs.frozen
class Box:
    """Half-open ``[start, stop)`` per dimension, in the full tensor's coordinates."""

    bounds: tuple[tuple[int, int], ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple((0, int(n)) for n in shape))

    @classmethod
    def along(cls, shape: Sequence[int], dim: int, start: int, stop: int) -> Box:
        """The whole tensor except ``[start, stop)`` on ``dim``."""
        b = [(0, int(n)) for n in shape]
        b[dim] = (start, stop)
        return cls(tuple(b))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.bounds)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def empty(self) -> bool:
        return any(e <= s for s, e in self.bounds)

    def intersect(self, other: Box) -> Box | None:
        """The common box, or ``None`` when they share no element."""
        b = tuple(
            (max(s1, s2), min(e1, e2)) for (s1, e1), (s2, e2) in zip(self.bounds, other.bounds, strict=True)
        )
        out = Box(b)
        return None if out.empty else out

    def within(self, outer: Box) -> bool:
        return all(
            s2 <= s1 and e1 <= e2 for (s1, e1), (s2, e2) in zip(self.bounds, outer.bounds, strict=True)
        )

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (a local shard's own indices)."""
        return Box(tuple((s - o, e - o) for (s, e), (o, _) in zip(self.bounds, outer.bounds, strict=True)))

    def split(self, parts: int) -> tuple[Box, ...]:
        """Up to ``parts`` near-equal boxes along the outermost dim with more than one index."""
        for d, (s, e) in enumerate(self.bounds):
            if e - s > 1:
                n = min(parts, e - s)
                cuts = [s + (e - s) * i // n for i in range(n + 1)]
                return tuple(
                    Box((*self.bounds[:d], (a, b), *self.bounds[d + 1 :])) for a, b in pairwise(cuts)
                )
        return (self,)

    def runs(self, shape: Sequence[int], item: int) -> list[tuple[int, int]]:
        """The exact byte ranges ``(offset, length)`` of this box in a row-major tensor of
        ``shape`` with ``item`` bytes per element, in wire order (adjacent runs merged)."""
        dims = len(shape)
        # the innermost dims the box covers fully form one contiguous run
        inner = dims
        while inner > 0 and self.bounds[inner - 1] == (0, shape[inner - 1]):
            inner -= 1
        if inner == 0:
            return [(0, math.prod(shape) * item)] if math.prod(shape) else []
        strides = [math.prod(shape[d + 1 :]) for d in range(dims)]
        s, e = self.bounds[inner - 1]
        length = (e - s) * strides[inner - 1] * item
        out: list[tuple[int, int]] = []
        outer = [range(a, b) for a, b in self.bounds[: inner - 1]]
        for idx in _product(outer):
            off = (sum(i * strides[d] for d, i in enumerate(idx)) + s * strides[inner - 1]) * item
            if out and out[-1][0] + out[-1][1] == off:
                out[-1] = (out[-1][0], out[-1][1] + length)
            else:
                out.append((off, length))
        return out

    def to_wire(self) -> list[list[int]]:
        return [[s, e] for s, e in self.bounds]

    @classmethod
    def from_wire(cls, value: Any, shape: Sequence[int], what: str) -> Box:
        """A box inside ``shape``.  Raises ``InvalidRequest`` (``invalid_layout``)."""
        if not isinstance(value, list) or len(value) != len(shape):
            raise bad_layout(f"{what} must be a list of {len(shape)} [start, stop] pairs", what)
        bounds = []
        for d, pair in enumerate(value):
            if not isinstance(pair, list) or len(pair) != 2:
                raise bad_layout(f"{what}[{d}] must be a [start, stop] pair", what)
            s = wire_int(pair[0], f"{what}[{d}][0]", 0, shape[d])
            e = wire_int(pair[1], f"{what}[{d}][1]", s, shape[d])
            bounds.append((s, e))
        return cls(tuple(bounds))


MAX_TILE_PIECES: Final = 1 << 16
"""The most pieces a plan part may cut one tensor into on one rank (65,536): a part over it
is refused (``too_many_pieces``) before its pieces are checked.  A plan from
:func:`~weightsync.core.plan.build.make_plan` cuts a tensor into at most one piece per
source rank, so any real plan stays far below it."""

MAX_OVERLAP_STEPS: Final = 1 << 24
"""The most box comparisons :func:`overlapping` makes for pieces that differ on three or
more dims (they are compared among those overlapping on the first, not sorted); beyond it
the pieces are refused (``too_many_pieces``).  Pieces that differ on one or two dims — every
FSDP × TP plan — are checked by a sort or a sweep, in O(n log n)."""


def too_many_pieces(message: str) -> InvalidRequest:
    """The error for a part whose pieces exceed what is checked (:data:`MAX_TILE_PIECES`)."""
    return InvalidRequest(message, code="too_many_pieces")


def overlapping(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` that share an element, or ``None``.  Boxes that differ on one dim
    only (slices along it) are checked by sorting, on two dims by a sweep along the first
    keeping the boxes it crosses ordered along the second (both O(n log n)); others by a
    sweep along the first with the crossed boxes compared, at most :data:`MAX_OVERLAP_STEPS`
    comparisons.  Raises ``InvalidRequest`` (``too_many_pieces``) beyond that."""
    live = [b for b in boxes if not b.empty]
    if len(live) < 2:
        return None
    first = live[0].bounds
    differ = [d for d in range(len(first)) if any(b.bounds[d] != first[d] for b in live)]
    if not differ:
        return live[0], live[1]  # the same non-empty box twice
    if len(differ) == 1:
        (dim,) = differ
        ordered = sorted(live, key=lambda b: b.bounds[dim])
        reach = ordered[0]  # the box reaching furthest along dim so far
        for b in ordered[1:]:
            if b.bounds[dim][0] < reach.bounds[dim][1]:
                return reach, b
            if b.bounds[dim][1] > reach.bounds[dim][1]:
                reach = b
        return None
    if len(differ) == 2:
        return _sweep2(live, *differ)
    return _sweep(live, differ[0])


def _sweep2(boxes: list[Box], p: int, q: int) -> tuple[Box, Box] | None:
    """Boxes that differ on dims ``p`` and ``q`` only: sweep along ``p``; the boxes the sweep
    crosses must be disjoint along ``q``, so they are kept sorted by their start on ``q`` and
    a new one is compared with its two neighbours only."""
    ordered = sorted(boxes, key=lambda b: b.bounds[p][0])
    ending: list[tuple[int, int, int]] = []  # (stop on p, start on q, index): who leaves first
    starts: list[int] = []  # the crossed boxes' starts on q, sorted
    crossed: list[Box] = []  # ... and the boxes, in that order
    for i, b in enumerate(ordered):
        at = b.bounds[p][0]
        while ending and ending[0][0] <= at:
            _, qs, _ = heapq.heappop(ending)
            k = bisect.bisect_left(starts, qs)
            del starts[k], crossed[k]
        qs, qe = b.bounds[q]
        k = bisect.bisect_left(starts, qs)
        if k > 0 and crossed[k - 1].bounds[q][1] > qs:
            return crossed[k - 1], b
        if k < len(starts) and starts[k] < qe:
            return crossed[k], b
        starts.insert(k, qs)
        crossed.insert(k, b)
        heapq.heappush(ending, (b.bounds[p][1], qs, i))
    return None


def _sweep(boxes: list[Box], p: int) -> tuple[Box, Box] | None:
    """Any boxes: sweep along ``p``, each new box compared with the boxes the sweep crosses."""
    ordered = sorted(boxes, key=lambda b: b.bounds[p][0])
    crossed: list[Box] = []
    steps = 0
    for b in ordered:
        at = b.bounds[p][0]
        crossed = [c for c in crossed if c.bounds[p][1] > at]
        steps += len(crossed) + 1
        if steps > MAX_OVERLAP_STEPS:
            raise too_many_pieces(
                f"{len(boxes)} pieces cut on three or more dims take more than {MAX_OVERLAP_STEPS} "
                "comparisons to check: cut tensors on at most two dims, or into fewer pieces"
            )
        for c in crossed:
            if c.intersect(b) is not None:
                return c, b
        crossed.append(b)
    return None


def _product(ranges: list[range]) -> Any:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``parts`` chunks of ``n`` as ``torch.chunk`` cuts them
    (FSDP's dim-0 sharding): ``ceil(n / parts)`` each, the last ones shorter or empty."""
    size = -(-n // parts) if parts else 0
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]


def even_bounds(n: int, parts: int, what: str) -> list[tuple[int, int]]:
    """``parts`` equal chunks of ``n`` (a TP split).  Raises ``InvalidRequest`` unless ``parts``
    divides ``n``."""
    if n % parts:
        raise bad_layout(f"{what}: size {n} does not split into {parts} equal TP shards", what)
    k = n // parts
    return [(i * k, (i + 1) * k) for i in range(parts)]


def box_nbytes(box: Box, dtype: str) -> int:
    """The bytes of ``box``'s elements of ``dtype``."""
    return box.numel * itemsize(dtype)
