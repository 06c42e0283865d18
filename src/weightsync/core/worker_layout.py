"""Worker and fleet layouts as data: which slice of each tensor each worker rank serves.

:class:`WorkerLayout` — one worker (a replica): for each of its ranks, the
:class:`~.boxes.Box` of each tensor that rank serves (the whole tensor for a replicated
weight, a TP shard otherwise).  :class:`FleetLayout` is the workers of a fleet, in order.

Both follow :mod:`.trainer_layout`'s conventions (frozen, validated, a versioned wire form
whose parser raises ``invalid_layout``).  Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from weightsync.core.boxes import Box, even_bounds
from weightsync.core.layout_wire import (
    MAX_RANKS,
    MAX_TENSORS,
    bad_layout,
    spec_from_wire,
    spec_to_wire,
    wire_list,
    wire_object,
)
from weightsync.core.values import TensorSpec

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
    for r, boxes in enumerate(inst.serves):
        if len(boxes) != len(inst.tensors):
            raise bad_layout(
                f"{inst.worker}: rank {r} lists {len(boxes)} boxes for {len(inst.tensors)} tensors"
            )
        for spec, box in zip(inst.tensors, boxes, strict=True):
            if len(box.bounds) != len(spec.shape) or not box.within(Box.full(spec.shape)):
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
