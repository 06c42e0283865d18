"""Layouts as data: which trainer rank holds which slice of each tensor, and which slice
each worker rank serves.

A slice of a tensor is a :class:`Box`: one half-open interval ``[start, stop)`` per
dimension, in the coordinates of the *full* tensor.  A TP shard on dimension 1 of a
``[4096, 11008]`` weight is ``Box(((0, 4096), (0, 5504)))``; it is not one contiguous byte
range of the full tensor but 4096 of them (one per dim-0 index).  Every range in a layout or
a plan is therefore a box, and its bytes are defined as the box's elements in row-major (C)
order: that is the order they travel in on the wire, and the order in which
:meth:`Box.runs` lists the exact byte ranges of the full tensor they come from.  A box
restricted on dim 0 only is one contiguous byte range.

- :class:`TrainerLayout` — per tensor, a tuple of :class:`Holding` (a box and the trainer
  ranks holding exactly those elements).  The holdings' boxes tile the tensor: disjoint
  and covering.  One holding on one rank is a tensor owned whole; one per rank along dim 0
  is FSDP; along another dim, TP; one box on every rank is a replicated tensor; HSDP is
  boxes held by several ranks each.
- :class:`WorkerLayout` — one worker (a replica): for each of its ranks, the box of each
  tensor that rank serves (the whole tensor for a replicated weight, a TP shard otherwise).
  :class:`FleetLayout` is the workers of a fleet, in order.

All values are frozen and validated on construction; ``to_wire``/``from_wire`` give the
JSON form (``format`` names the version), and ``from_wire`` turns any malformed input into
``InvalidRequest`` (``invalid_layout``).  Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any, Final

import attrs

from .dtypes import DTYPES, itemsize
from .errors import InvalidRequest
from .values import TensorSpec

MAX_RANKS: Final = 65536
MAX_TENSORS: Final = 1 << 20
MAX_DIMS: Final = 16
TRAINER_FORMAT: Final = "weightsync.trainer_layout/1"
WORKER_FORMAT: Final = "weightsync.worker_layout/1"
FLEET_FORMAT: Final = "weightsync.fleet_layout/1"


def _bad(message: str, field: str | None = None) -> InvalidRequest:
    extra = {"field": field} if field else {}
    return InvalidRequest(message, code="invalid_layout", **extra)


def _int(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bound = f" and at most {hi}" if hi is not None else ""
        raise _bad(f"{what} must be an integer of at least {lo}{bound}, got {value!r}", what)
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
            raise _bad(f"{what} must be a list of {len(shape)} [start, stop] pairs", what)
        bounds = []
        for d, pair in enumerate(value):
            if not isinstance(pair, list) or len(pair) != 2:
                raise _bad(f"{what}[{d}] must be a [start, stop] pair", what)
            s = _int(pair[0], f"{what}[{d}][0]", 0, shape[d])
            e = _int(pair[1], f"{what}[{d}][1]", s, shape[d])
            bounds.append((s, e))
        return cls(tuple(bounds))


def overlapping(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` that share an element, or ``None``.  Boxes that differ on one dim
    only (slices along it) are checked by sorting, others pairwise."""
    if len(boxes) < 2:
        return None
    first = boxes[0].bounds
    differ = {d for b in boxes for d, iv in enumerate(b.bounds) if iv != first[d]}
    if len(differ) == 1:
        (dim,) = differ
        ordered = sorted((b for b in boxes if not b.empty), key=lambda b: b.bounds[dim])
        reach: Box | None = None  # the box reaching furthest along dim so far
        for b in ordered:
            if reach is not None and b.bounds[dim][0] < reach.bounds[dim][1]:
                return reach, b
            if reach is None or b.bounds[dim][1] > reach.bounds[dim][1]:
                reach = b
        return None
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if a.intersect(b) is not None:
                return a, b
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
        raise _bad(f"{what}: size {n} does not split into {parts} equal TP shards", what)
    k = n // parts
    return [(i * k, (i + 1) * k) for i in range(parts)]


def _spec_wire(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)}


def _spec_from_wire(value: Any, what: str) -> TensorSpec:
    if not isinstance(value, dict):
        raise _bad(f"{what} must be an object", what)
    name, dtype, shape = value.get("name"), value.get("dtype"), value.get("shape")
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise _bad(f"{what}.name must be a non-empty string of at most 1024 characters", what)
    if dtype not in DTYPES:
        raise _bad(f"{what}.dtype {dtype!r} is not a known dtype", what)
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise _bad(f"{what}.shape must be a list of at most {MAX_DIMS} sizes", what)
    return TensorSpec(name, str(dtype), tuple(_int(n, f"{what}.shape", 0, 1 << 48) for n in shape))


def _check_keys(value: Any, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(f"{what} must be an object", what)
    unknown = set(value) - keys
    if unknown:
        raise _bad(f"{what} has unknown fields {sorted(unknown)}", what)
    return value


def _list(value: Any, what: str, limit: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise _bad(f"{what} must be a list of at most {limit} entries", what)
    return value


# ---------------------------------------------------------------------------- trainer


@attrs.frozen
class Holding:
    """``box`` of a tensor, held (identically) by every rank in ``ranks``."""

    box: Box
    ranks: tuple[int, ...]


def _check_tensor(inst: TensorLayout, _a: Any, _v: Any) -> None:
    spec = inst.spec
    if not inst.holdings:
        raise _bad(f"{spec.name}: no rank holds it")
    total = 0
    for h in inst.holdings:
        if (
            len(h.box.bounds) != len(spec.shape)
            or not h.box.within(Box.full(spec.shape))
            or (h.box.empty and math.prod(spec.shape) > 0)
        ):
            raise _bad(f"{spec.name}: holding {h.box.to_wire()} is not a non-empty box of {list(spec.shape)}")
        if not h.ranks or len(set(h.ranks)) != len(h.ranks) or list(h.ranks) != sorted(h.ranks):
            raise _bad(f"{spec.name}: holding ranks {list(h.ranks)} must be distinct and ascending")
        total += h.box.numel
    clash = overlapping([h.box for h in inst.holdings])
    if clash is not None:
        raise _bad(f"{spec.name}: holdings {clash[0].to_wire()} and {clash[1].to_wire()} overlap")
    if total != math.prod(spec.shape):
        raise _bad(f"{spec.name}: the holdings cover {total} of {math.prod(spec.shape)} elements")


@attrs.frozen
class TensorLayout:
    """Where one tensor lives in the trainer: holdings that tile it."""

    spec: TensorSpec
    holdings: tuple[Holding, ...] = attrs.field(validator=_check_tensor)


def _check_trainer(inst: TrainerLayout, _a: Any, _v: Any) -> None:
    if not 1 <= inst.ranks <= MAX_RANKS:
        raise _bad(f"ranks must be between 1 and {MAX_RANKS}, got {inst.ranks}", "ranks")
    names = set()
    for t in inst.tensors:
        if t.spec.name in names:
            raise _bad(f"tensor {t.spec.name!r} appears twice", "tensors")
        names.add(t.spec.name)
        for h in t.holdings:
            if h.ranks[-1] >= inst.ranks:
                raise _bad(f"{t.spec.name}: rank {h.ranks[-1]} is not below ranks={inst.ranks}", "tensors")


@attrs.frozen
class TrainerLayout:
    """Which of ``ranks`` trainer ranks holds which slice of each tensor."""

    ranks: int
    tensors: tuple[TensorLayout, ...] = attrs.field(validator=_check_trainer)

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(t.spec for t in self.tensors)

    def held_by(self, rank: int) -> dict[str, tuple[Box, ...]]:
        """The boxes ``rank`` holds, by tensor name (what it must be able to send)."""
        out: dict[str, tuple[Box, ...]] = {}
        for t in self.tensors:
            boxes = tuple(h.box for h in t.holdings if rank in h.ranks)
            if boxes:
                out[t.spec.name] = boxes
        return out

    @classmethod
    def whole(cls, specs: Sequence[TensorSpec], ranks: int) -> TrainerLayout:
        """Each tensor owned whole by one rank, largest first onto the least-loaded rank."""
        load = [0] * ranks
        owner: dict[int, int] = {}
        order = sorted(range(len(specs)), key=lambda i: (-_nbytes(specs[i]), i))
        for i in order:
            r = min(range(ranks), key=lambda k: (load[k], k))
            owner[i] = r
            load[r] += _nbytes(specs[i])
        return cls(
            ranks,
            tuple(TensorLayout(s, (Holding(Box.full(s.shape), (owner[i],)),)) for i, s in enumerate(specs)),
        )

    @classmethod
    def sharded(
        cls, specs: Sequence[TensorSpec], ranks: int, dims: Mapping[str, int | None] | None = None
    ) -> TrainerLayout:
        """Each tensor cut into ``ranks`` ``torch.chunk``-style shards on ``dims[name]`` (dim 0
        where not given: FSDP); ``None`` replicates the tensor on every rank; a 0-d tensor
        is replicated.  Empty shards are left out."""
        out = []
        for s in specs:
            dim = (dims or {}).get(s.name, 0)
            if dim is None or not s.shape or s.shape[dim] == 0:
                out.append(TensorLayout(s, (Holding(Box.full(s.shape), tuple(range(ranks))),)))
                continue
            holdings = tuple(
                Holding(Box.along(s.shape, dim, a, b), (r,))
                for r, (a, b) in enumerate(chunk_bounds(s.shape[dim], ranks))
                if b > a
            )
            out.append(TensorLayout(s, holdings))
        return cls(ranks, tuple(out))

    @classmethod
    def fsdp(cls, specs: Sequence[TensorSpec], ranks: int) -> TrainerLayout:
        """FSDP: every tensor sharded on dim 0 across all ranks (``torch.chunk`` cuts)."""
        return cls.sharded(specs, ranks)

    @classmethod
    def tp(cls, specs: Sequence[TensorSpec], ranks: int) -> TrainerLayout:
        """Megatron-style TP by Hugging Face names (:func:`tp_dims`), ``torch.chunk`` cuts."""
        return cls.sharded(specs, ranks, tp_dims(specs, shard_embeddings=True))

    @classmethod
    def replicated(cls, specs: Sequence[TensorSpec], ranks: int) -> TrainerLayout:
        return cls.sharded(specs, ranks, {s.name: None for s in specs})

    def to_wire(self) -> dict[str, Any]:
        return {
            "format": TRAINER_FORMAT,
            "ranks": self.ranks,
            "tensors": [
                {
                    **_spec_wire(t.spec),
                    "holdings": [{"box": h.box.to_wire(), "ranks": list(h.ranks)} for h in t.holdings],
                }
                for t in self.tensors
            ],
        }

    @classmethod
    def from_wire(cls, value: Any) -> TrainerLayout:
        """Raises ``InvalidRequest`` (``invalid_layout``) for anything malformed."""
        v = _check_keys(value, {"format", "ranks", "tensors"}, "trainer_layout")
        if v.get("format") != TRAINER_FORMAT:
            raise _bad(f"format must be {TRAINER_FORMAT!r}", "format")
        ranks = _int(v.get("ranks"), "ranks", 1, MAX_RANKS)
        tensors = []
        for i, t in enumerate(_list(v.get("tensors"), "tensors", MAX_TENSORS)):
            t = _check_keys(t, {"name", "dtype", "shape", "holdings"}, f"tensors[{i}]")
            spec = _spec_from_wire(t, f"tensors[{i}]")
            holdings = []
            for j, h in enumerate(_list(t.get("holdings"), f"tensors[{i}].holdings", MAX_RANKS)):
                h = _check_keys(h, {"box", "ranks"}, f"tensors[{i}].holdings[{j}]")
                box = Box.from_wire(h.get("box"), spec.shape, f"tensors[{i}].holdings[{j}].box")
                rs = tuple(
                    _int(r, f"tensors[{i}].holdings[{j}].ranks", 0, ranks - 1)
                    for r in _list(h.get("ranks"), f"tensors[{i}].holdings[{j}].ranks", MAX_RANKS)
                )
                holdings.append(Holding(box, rs))
            tensors.append(TensorLayout(spec, tuple(holdings)))
        return cls(ranks, tuple(tensors))


# ---------------------------------------------------------------------------- workers


def _check_worker(inst: WorkerLayout, _a: Any, _v: Any) -> None:
    if not inst.worker or len(inst.worker) > 2048:
        raise _bad("worker must be a non-empty name of at most 2048 characters", "worker")
    if not 1 <= len(inst.serves) <= MAX_RANKS:
        raise _bad(f"{inst.worker}: a worker has between 1 and {MAX_RANKS} ranks", "serves")
    names = [s.name for s in inst.tensors]
    if len(set(names)) != len(names):
        raise _bad(f"{inst.worker}: a tensor appears twice", "tensors")
    for r, boxes in enumerate(inst.serves):
        if len(boxes) != len(inst.tensors):
            raise _bad(f"{inst.worker}: rank {r} lists {len(boxes)} boxes for {len(inst.tensors)} tensors")
        for spec, box in zip(inst.tensors, boxes, strict=True):
            if len(box.bounds) != len(spec.shape) or not box.within(Box.full(spec.shape)):
                raise _bad(
                    f"{inst.worker}: rank {r} serves {box.to_wire()} outside {spec.name} {list(spec.shape)}"
                )


@attrs.frozen
class WorkerLayout:
    """One worker: its full tensors, and for each rank the box of each tensor it serves
    (``serves[rank][i]`` is the box of ``tensors[i]``)."""

    worker: str
    tensors: tuple[TensorSpec, ...]
    serves: tuple[tuple[Box, ...], ...] = attrs.field(validator=_check_worker)

    @property
    def world_size(self) -> int:
        return len(self.serves)

    def served(self, rank: int) -> dict[str, Box]:
        return {s.name: b for s, b in zip(self.tensors, self.serves[rank], strict=True)}

    @classmethod
    def replica(cls, worker: str, specs: Sequence[TensorSpec]) -> WorkerLayout:
        """A single-rank worker serving every tensor whole."""
        return cls.tensor_parallel(worker, specs, 1, {})

    @classmethod
    def tensor_parallel(
        cls, worker: str, specs: Sequence[TensorSpec], tp: int, dims: Mapping[str, int | None]
    ) -> WorkerLayout:
        """``tp`` ranks; tensor ``name`` split into equal shards on ``dims[name]``, whole on
        every rank where ``dims`` gives ``None`` or omits it.  Raises ``InvalidRequest`` when a
        sharded size does not divide by ``tp``."""
        specs = tuple(specs)
        serves = []
        for r in range(tp):
            boxes = []
            for s in specs:
                dim = dims.get(s.name)
                if dim is None or tp == 1:
                    boxes.append(Box.full(s.shape))
                else:
                    a, b = even_bounds(s.shape[dim], tp, s.name)[r]
                    boxes.append(Box.along(s.shape, dim, a, b))
            serves.append(tuple(boxes))
        return cls(worker, specs, tuple(serves))

    def to_wire(self) -> dict[str, Any]:
        return {
            "format": WORKER_FORMAT,
            "worker": self.worker,
            "tensors": [_spec_wire(s) for s in self.tensors],
            "serves": [[b.to_wire() for b in boxes] for boxes in self.serves],
        }

    @classmethod
    def from_wire(cls, value: Any) -> WorkerLayout:
        """Raises ``InvalidRequest`` (``invalid_layout``) for anything malformed."""
        v = _check_keys(value, {"format", "worker", "tensors", "serves"}, "worker_layout")
        if v.get("format") != WORKER_FORMAT:
            raise _bad(f"format must be {WORKER_FORMAT!r}", "format")
        worker = v.get("worker")
        if not isinstance(worker, str):
            raise _bad("worker must be a string", "worker")
        specs = tuple(
            _spec_from_wire(s, f"tensors[{i}]")
            for i, s in enumerate(_list(v.get("tensors"), "tensors", MAX_TENSORS))
        )
        serves = []
        for r, boxes in enumerate(_list(v.get("serves"), "serves", MAX_RANKS)):
            boxes = _list(boxes, f"serves[{r}]", MAX_TENSORS)
            if len(boxes) != len(specs):
                raise _bad(f"serves[{r}] must give one box per tensor", f"serves[{r}]")
            serves.append(
                tuple(
                    Box.from_wire(b, s.shape, f"serves[{r}][{i}]")
                    for i, (b, s) in enumerate(zip(boxes, specs, strict=True))
                )
            )
        return cls(worker, specs, tuple(serves))


def _check_fleet(inst: FleetLayout, _a: Any, _v: Any) -> None:
    names = [w.worker for w in inst.workers]
    if not names:
        raise _bad("a fleet layout has at least one worker", "workers")
    if len(set(names)) != len(names):
        raise _bad("a worker appears twice in the fleet layout", "workers")


@attrs.frozen
class FleetLayout:
    """The workers a plan delivers to, in order (their group ranks follow this order)."""

    workers: tuple[WorkerLayout, ...] = attrs.field(validator=_check_fleet)

    def to_wire(self) -> dict[str, Any]:
        return {"format": FLEET_FORMAT, "workers": [w.to_wire() for w in self.workers]}

    @classmethod
    def from_wire(cls, value: Any) -> FleetLayout:
        v = _check_keys(value, {"format", "workers"}, "fleet_layout")
        if v.get("format") != FLEET_FORMAT:
            raise _bad(f"format must be {FLEET_FORMAT!r}", "format")
        return cls(tuple(WorkerLayout.from_wire(w) for w in _list(v.get("workers"), "workers", MAX_RANKS)))


# ---------------------------------------------------------------------------- name rules

COLUMN_PARALLEL: Final = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
ROW_PARALLEL: Final = ("o_proj", "down_proj")


def tp_dims(specs: Sequence[TensorSpec], *, shard_embeddings: bool) -> dict[str, int | None]:
    """Megatron's TP rule by Hugging Face names: column-parallel projections (and their
    biases) on dim 0, row-parallel weights on dim 1 (their biases whole), norms whole;
    ``embed_tokens``/``lm_head`` on dim 0 (vocab-parallel) when ``shard_embeddings``, whole
    otherwise."""
    out: dict[str, int | None] = {}
    for s in specs:
        parts = s.name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module in COLUMN_PARALLEL:
            out[s.name] = 0
        elif module in ROW_PARALLEL and parts[-1] == "weight" and len(s.shape) == 2:
            out[s.name] = 1
        elif module in ("embed_tokens", "lm_head") and shard_embeddings:
            out[s.name] = 0
        else:
            out[s.name] = None
    return out


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * itemsize(spec.dtype)
