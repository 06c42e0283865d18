"""Trainer layouts as data: which trainer rank holds which slice of each tensor.

:class:`TrainerLayout` — per tensor, a tuple of :class:`Holding` (a :class:`~.boxes.Box`
and the trainer ranks holding exactly those elements).  The holdings' boxes tile the
tensor: disjoint and covering.  One holding on one rank is a tensor owned whole; one per
rank along dim 0 is FSDP; along another dim, TP; one box on every rank is a replicated
tensor; HSDP is boxes held by several ranks each.

Frozen and validated on construction; ``to_wire``/``from_wire`` give the JSON form
(``format`` names the version), and ``from_wire`` turns any malformed input into
``InvalidRequest`` (``invalid_layout``).  Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from weightsync.core.boxes import Box, chunk_bounds, overlapping
from weightsync.core.dtypes import itemsize
from weightsync.core.layout_wire import (
    MAX_RANKS,
    MAX_TENSORS,
    bad_layout,
    spec_from_wire,
    spec_to_wire,
    wire_int,
    wire_list,
    wire_object,
)
from weightsync.core.tp_rules import tp_dims
from weightsync.core.values import TensorSpec

TRAINER_FORMAT: Final = "weightsync.trainer_layout/1"


@attrs.frozen
class Holding:
    """``box`` of a tensor, held (identically) by every rank in ``ranks``."""

    box: Box
    ranks: tuple[int, ...]


def _check_tensor(inst: TensorLayout, _a: Any, _v: Any) -> None:
    spec = inst.spec
    if not inst.holdings:
        raise bad_layout(f"{spec.name}: no rank holds it")
    total = 0
    for h in inst.holdings:
        if (
            len(h.box.bounds) != len(spec.shape)
            or not h.box.within(Box.full(spec.shape))
            or (h.box.empty and math.prod(spec.shape) > 0)
        ):
            raise bad_layout(
                f"{spec.name}: holding {h.box.to_wire()} is not a non-empty box of {list(spec.shape)}"
            )
        if not h.ranks or len(set(h.ranks)) != len(h.ranks) or list(h.ranks) != sorted(h.ranks):
            raise bad_layout(f"{spec.name}: holding ranks {list(h.ranks)} must be distinct and ascending")
        total += h.box.numel
    clash = overlapping([h.box for h in inst.holdings])
    if clash is not None:
        raise bad_layout(f"{spec.name}: holdings {clash[0].to_wire()} and {clash[1].to_wire()} overlap")
    if total != math.prod(spec.shape):
        raise bad_layout(f"{spec.name}: the holdings cover {total} of {math.prod(spec.shape)} elements")


@attrs.frozen
class TensorLayout:
    """Where one tensor lives in the trainer: holdings that tile it."""

    spec: TensorSpec
    holdings: tuple[Holding, ...] = attrs.field(validator=_check_tensor)


def _check_trainer(inst: TrainerLayout, _a: Any, _v: Any) -> None:
    if not 1 <= inst.ranks <= MAX_RANKS:
        raise bad_layout(f"ranks must be between 1 and {MAX_RANKS}, got {inst.ranks}", "ranks")
    names = set()
    for t in inst.tensors:
        if t.spec.name in names:
            raise bad_layout(f"tensor {t.spec.name!r} appears twice", "tensors")
        names.add(t.spec.name)
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


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * itemsize(spec.dtype)
