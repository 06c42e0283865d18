"""Layouts as data: which trainer rank holds which slice of each tensor, and which slice each worker
rank serves.  Pure Python.

* Megatron's tensor-parallel rule by Hugging Face tensor names (:func:`tp_dims`): which dim of
  each tensor a TP split cuts, or none.
* :class:`TrainerLayout` — per tensor, a tuple of :class:`Holding` (a :class:`~.boxes.Box`
  held by one trainer rank).
* :class:`WorkerLayout` — one worker (a replica): for each of its ranks, the box of each tensor
  it serves; :class:`FleetLayout` — the workers of a fleet, each at its group ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from weightsync.core.dtypes import itemsize
from weightsync.core.plan.boxes import (
    MAX_RANKS,
    MAX_TENSORS,
    Box,
    bad_layout,
    chunk_bounds,
    even_bounds,
    overlapping,
    spec_from_wire,
    spec_to_wire,
    wire_int,
    wire_list,
    wire_object,
)
from weightsync.core.snapshot import TensorSpec

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


TRAINER_FORMAT: Final = "weightsync.trainer_layout/1"


@attrs.frozen
class Holding:
    """``box`` of a tensor, held (identically) by every rank in ``ranks``."""

    box: Box
    ranks: tuple[int, ...]


_PASSED: dict[int, tuple[tuple[Holding, ...], tuple[int, ...]]] = {}
"""Holdings that passed :func:`_check_tensor`, by identity, with the shape they passed for
(kept alive here, so an id is not reused while it is a key): tensors that share one holdings
tuple (``TrainerLayout.sharded`` gives all tensors of one shape the same) are checked once."""


def _check_tensor(inst: TensorLayout, _a: Any, _v: Any) -> None:
    spec, holdings = inst.spec, inst.holdings
    seen = _PASSED.get(id(holdings))
    if seen is not None and seen[0] is holdings and seen[1] == spec.shape:
        return
    if not holdings:
        raise bad_layout(f"{spec.name}: no rank holds it")
    full, size = Box.full(spec.shape), math.prod(spec.shape)
    total = 0
    for h in holdings:
        if len(h.box.bounds) != len(spec.shape) or not h.box.within(full) or (h.box.empty and size > 0):
            raise bad_layout(
                f"{spec.name}: holding {h.box.to_wire()} is not a non-empty box of {list(spec.shape)}"
            )
        if not h.ranks or len(set(h.ranks)) != len(h.ranks) or list(h.ranks) != sorted(h.ranks):
            raise bad_layout(f"{spec.name}: holding ranks {list(h.ranks)} must be distinct and ascending")
        total += h.box.numel
    clash = overlapping([h.box for h in holdings])
    if clash is not None:
        raise bad_layout(f"{spec.name}: holdings {clash[0].to_wire()} and {clash[1].to_wire()} overlap")
    if total != size:
        raise bad_layout(f"{spec.name}: the holdings cover {total} of {size} elements")
    if len(_PASSED) >= 256:
        _PASSED.clear()
    _PASSED[id(holdings)] = (holdings, spec.shape)


@attrs.frozen
class TensorLayout:
    """Where one tensor lives in the trainer: holdings that tile it."""

    spec: TensorSpec
    holdings: tuple[Holding, ...] = attrs.field(validator=_check_tensor)


def _check_trainer(inst: TrainerLayout, _a: Any, _v: Any) -> None:
    if not 1 <= inst.ranks <= MAX_RANKS:
        raise bad_layout(f"ranks must be between 1 and {MAX_RANKS}, got {inst.ranks}", "ranks")
    names = set()
    shared = set()  # ids of holdings tuples already checked (alive: inst holds them)
    for t in inst.tensors:
        if t.spec.name in names:
            raise bad_layout(f"tensor {t.spec.name!r} appears twice", "tensors")
        names.add(t.spec.name)
        if id(t.holdings) in shared:
            continue
        shared.add(id(t.holdings))
        for h in t.holdings:
            if h.ranks[-1] >= inst.ranks:
                raise bad_layout(
                    f"{t.spec.name}: rank {h.ranks[-1]} is not below ranks={inst.ranks}", "tensors"
                )


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
        is replicated.  Empty shards are left out.  Tensors of one shape cut on one dim
        share their holdings."""
        out = []
        made: dict[tuple[tuple[int, ...], int | None], tuple[Holding, ...]] = {}
        for s in specs:
            dim = (dims or {}).get(s.name, 0)
            if dim is None or not s.shape or s.shape[dim] == 0:
                dim = None
            holdings = made.get((s.shape, dim))
            if holdings is None:
                holdings = made[(s.shape, dim)] = _cut(s.shape, dim, ranks)
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
                    **spec_to_wire(t.spec),
                    "holdings": [{"box": h.box.to_wire(), "ranks": list(h.ranks)} for h in t.holdings],
                }
                for t in self.tensors
            ],
        }

    @classmethod
    def from_wire(cls, value: Any) -> TrainerLayout:
        """Raises ``InvalidRequest`` (``invalid_layout``) for anything malformed."""
        v = wire_object(value, {"format", "ranks", "tensors"}, "trainer_layout")
        if v.get("format") != TRAINER_FORMAT:
            raise bad_layout(f"format must be {TRAINER_FORMAT!r}", "format")
        ranks = wire_int(v.get("ranks"), "ranks", 1, MAX_RANKS)
        tensors = []
        for i, t in enumerate(wire_list(v.get("tensors"), "tensors", MAX_TENSORS)):
            t = wire_object(t, {"name", "dtype", "shape", "holdings"}, f"tensors[{i}]")
            spec = spec_from_wire(t, f"tensors[{i}]")
            holdings = []
            for j, h in enumerate(wire_list(t.get("holdings"), f"tensors[{i}].holdings", MAX_RANKS)):
                h = wire_object(h, {"box", "ranks"}, f"tensors[{i}].holdings[{j}]")
                box = Box.from_wire(h.get("box"), spec.shape, f"tensors[{i}].holdings[{j}].box")
                rs = tuple(
                    wire_int(r, f"tensors[{i}].holdings[{j}].ranks", 0, ranks - 1)
                    for r in wire_list(h.get("ranks"), f"tensors[{i}].holdings[{j}].ranks", MAX_RANKS)
                )
                holdings.append(Holding(box, rs))
            tensors.append(TensorLayout(spec, tuple(holdings)))
        return cls(ranks, tuple(tensors))


def _cut(shape: tuple[int, ...], dim: int | None, ranks: int) -> tuple[Holding, ...]:
    if dim is None:
        return (Holding(Box.full(shape), tuple(range(ranks))),)
    return tuple(
        Holding(Box.along(shape, dim, a, b), (r,))
        for r, (a, b) in enumerate(chunk_bounds(shape[dim], ranks))
        if b > a
    )


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * itemsize(spec.dtype)


WORKER_FORMAT: Final = "weightsync.worker_layout/1"
FLEET_FORMAT: Final = "weightsync.fleet_layout/1"


def _check_worker(inst: WorkerLayout, _a: Any, _v: Any) -> None:
    if not inst.worker or len(inst.worker) > 2048:
        raise bad_layout("worker must be a non-empty name of at most 2048 characters", "worker")
    if not 1 <= len(inst.serves) <= MAX_RANKS:
        raise bad_layout(f"{inst.worker}: a worker has between 1 and {MAX_RANKS} ranks", "serves")
    names = [s.name for s in inst.tensors]
    if len(set(names)) != len(names):
        raise bad_layout(f"{inst.worker}: a tensor appears twice", "tensors")
    fulls = [Box.full(s.shape) for s in inst.tensors]
    for r, boxes in enumerate(inst.serves):
        if len(boxes) != len(inst.tensors):
            raise bad_layout(
                f"{inst.worker}: rank {r} lists {len(boxes)} boxes for {len(inst.tensors)} tensors"
            )
        for spec, full, box in zip(inst.tensors, fulls, boxes, strict=True):
            if len(box.bounds) != len(spec.shape) or not box.within(full):
                raise bad_layout(
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
        made: dict[tuple[tuple[int, ...], int | None], list[Box]] = {}  # one shape, one cut: shared
        per_tensor = []
        for s in specs:
            dim = dims.get(s.name)
            dim = None if tp == 1 else dim
            boxes = made.get((s.shape, dim))
            if boxes is None:
                if dim is None:
                    boxes = [Box.full(s.shape)] * tp
                else:
                    boxes = [Box.along(s.shape, dim, a, b) for a, b in even_bounds(s.shape[dim], tp, s.name)]
                made[(s.shape, dim)] = boxes
            per_tensor.append(boxes)
        serves = [tuple(boxes[r] for boxes in per_tensor) for r in range(tp)]
        return cls(worker, specs, tuple(serves))

    def to_wire(self) -> dict[str, Any]:
        return {
            "format": WORKER_FORMAT,
            "worker": self.worker,
            "tensors": [spec_to_wire(s) for s in self.tensors],
            "serves": [[b.to_wire() for b in boxes] for boxes in self.serves],
        }

    @classmethod
    def from_wire(cls, value: Any) -> WorkerLayout:
        """Raises ``InvalidRequest`` (``invalid_layout``) for anything malformed."""
        v = wire_object(value, {"format", "worker", "tensors", "serves"}, "worker_layout")
        if v.get("format") != WORKER_FORMAT:
            raise bad_layout(f"format must be {WORKER_FORMAT!r}", "format")
        worker = v.get("worker")
        if not isinstance(worker, str):
            raise bad_layout("worker must be a string", "worker")
        specs = tuple(
            spec_from_wire(s, f"tensors[{i}]")
            for i, s in enumerate(wire_list(v.get("tensors"), "tensors", MAX_TENSORS))
        )
        serves = []
        for r, boxes in enumerate(wire_list(v.get("serves"), "serves", MAX_RANKS)):
            boxes = wire_list(boxes, f"serves[{r}]", MAX_TENSORS)
            if len(boxes) != len(specs):
                raise bad_layout(f"serves[{r}] must give one box per tensor", f"serves[{r}]")
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
        raise bad_layout("a fleet layout has at least one worker", "workers")
    if len(set(names)) != len(names):
        raise bad_layout("a worker appears twice in the fleet layout", "workers")


@attrs.frozen
class FleetLayout:
    """The workers a plan delivers to, in order (their group ranks follow this order)."""

    workers: tuple[WorkerLayout, ...] = attrs.field(validator=_check_fleet)

    def to_wire(self) -> dict[str, Any]:
        return {"format": FLEET_FORMAT, "workers": [w.to_wire() for w in self.workers]}

    @classmethod
    def from_wire(cls, value: Any) -> FleetLayout:
        v = wire_object(value, {"format", "workers"}, "fleet_layout")
        if v.get("format") != FLEET_FORMAT:
            raise bad_layout(f"format must be {FLEET_FORMAT!r}", "format")
        return cls(
            tuple(WorkerLayout.from_wire(w) for w in wire_list(v.get("workers"), "workers", MAX_RANKS))
        )
