"""A transfer plan as a value: every transfer of one update in execution order, the group ranks it
runs on, each worker's part, and the figures that say how well it balances.
:func:`~weightsync.core.plan.build.make_plan` builds it.  Pure Python.

A :class:`Transfer` is one point-to-point message carrying :class:`Piece` s (boxes of tensors);
a :class:`PlanPart` is one worker's part of a plan, with a wire form.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Final

import attrs

from weightsync.core.dtypes import itemsize
from weightsync.core.plan.boxes import (
    MAX_RANKS,
    MAX_TENSORS,
    Box,
    bad_layout,
    spec_from_wire,
    wire_int,
    wire_list,
    wire_object,
)
from weightsync.core.plan.layouts import FleetLayout, TrainerLayout
from weightsync.core.snapshot import TensorSpec

ALIGN: Final = 64
PART_FORMAT: Final = "weightsync.plan_part/1"


@attrs.frozen
class Piece:
    """``box`` of tensor ``name`` at ``offset`` in its transfer's buffer (``nbytes`` long)."""

    name: str
    box: Box
    offset: int
    nbytes: int


@attrs.frozen
class Transfer:
    """One point-to-point message from trainer rank ``src`` to ``worker``'s ``rank``."""

    index: int
    round: int
    src: int
    worker: int
    rank: int
    dst: int  # the destination's group rank
    buffer: int  # 0 or 1: the destination's packing buffer; -1: one piece, alone
    size: int
    pieces: tuple[Piece, ...]


@attrs.frozen
class PlanPart:
    """One worker's side of a plan: what it receives, from whom, and where it goes."""

    worker: str
    index: int
    sources: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    tensors: tuple[TensorSpec, ...]
    transfers: tuple[Transfer, ...]

    def for_rank(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.rank == rank)

    def to_wire(self) -> dict[str, Any]:
        return {
            "format": PART_FORMAT,
            "worker": self.worker,
            "index": self.index,
            "sources": self.sources,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in self.tensors],
            "transfers": [
                {
                    "index": t.index, "round": t.round, "src": t.src, "rank": t.rank, "dst": t.dst,
                    "buffer": t.buffer,
                    "size": t.size,
                    "pieces": [
                        {"name": p.name, "box": p.box.to_wire(), "offset": p.offset, "nbytes": p.nbytes}
                        for p in t.pieces
                    ],
                }
                for t in self.transfers
            ],
        }  # fmt: skip

    @classmethod
    def from_wire(cls, value: Any) -> PlanPart:
        """Parse (not yet check against a worker: :func:`~.plan_check.check_part`).  Raises
        ``InvalidRequest`` (``invalid_layout``) for anything malformed.

        A trainer posts a worker the same part on every push of a plan: the last part parsed
        is kept with its wire form's exact JSON text, and a wire whose text is the same (a
        ``1.0`` or ``true`` for a ``1`` is not) is that part again, not parsed anew."""
        try:
            text = json.dumps(value, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            text = None  # not JSON: parsing says why
        with _LAST_LOCK:
            last = _LAST_PARSED[0]
        if text is not None and last is not None and last[0] == text:
            return last[1]
        part = cls._parse(value)
        if text is not None:
            with _LAST_LOCK:
                _LAST_PARSED[0] = (text, part)
        return part

    @classmethod
    def _parse(cls, value: Any) -> PlanPart:
        keys = {
            "format",
            "worker",
            "index",
            "sources",
            "rank_offset",
            "world_size",
            "bucket_bytes",
            "tensors",
            "transfers",
        }
        v = wire_object(value, keys, "plan")
        if v.get("format") != PART_FORMAT:
            raise bad_layout(f"format must be {PART_FORMAT!r}", "format")
        worker = v.get("worker")
        if not isinstance(worker, str):
            raise bad_layout("plan.worker must be a string", "worker")
        index = wire_int(v.get("index"), "index", 0, MAX_RANKS)
        sources = wire_int(v.get("sources"), "sources", 1, MAX_RANKS)
        world = wire_int(v.get("world_size"), "world_size", 2, 2 * MAX_RANKS)
        offset = wire_int(v.get("rank_offset"), "rank_offset", sources, world - 1)
        bucket = wire_int(v.get("bucket_bytes"), "bucket_bytes", ALIGN, 1 << 40)
        specs = tuple(
            spec_from_wire(s, f"tensors[{i}]")
            for i, s in enumerate(wire_list(v.get("tensors"), "tensors", MAX_TENSORS))
        )
        by_name = {s.name: s for s in specs}
        if len(by_name) != len(specs):
            raise bad_layout("plan.tensors names a tensor twice", "tensors")
        transfers = []
        for i, t in enumerate(wire_list(v.get("transfers"), "transfers", 1 << 24)):
            t = wire_object(
                t, {"index", "round", "src", "rank", "dst", "buffer", "size", "pieces"}, f"transfers[{i}]"
            )
            pieces = []
            for j, p in enumerate(wire_list(t.get("pieces"), f"transfers[{i}].pieces", 1 << 20)):
                what = f"transfers[{i}].pieces[{j}]"
                p = wire_object(p, {"name", "box", "offset", "nbytes"}, what)
                spec = by_name.get(p.get("name"))  # type: ignore[arg-type]
                if spec is None:
                    raise bad_layout(f"{what}.name is not one of plan.tensors", what)
                box = Box.from_wire(p.get("box"), spec.shape, f"{what}.box")
                pieces.append(
                    Piece(
                        spec.name,
                        box,
                        wire_int(p.get("offset"), f"{what}.offset", 0, 1 << 48),
                        wire_int(p.get("nbytes"), f"{what}.nbytes", 0, 1 << 48),
                    )
                )
            transfers.append(
                Transfer(
                    wire_int(t.get("index"), f"transfers[{i}].index", 0, 1 << 31),
                    wire_int(t.get("round"), f"transfers[{i}].round", 0, 2 * MAX_RANKS),
                    wire_int(t.get("src"), f"transfers[{i}].src", 0, sources - 1),
                    index,
                    wire_int(t.get("rank"), f"transfers[{i}].rank", 0, world - offset - 1),
                    wire_int(t.get("dst"), f"transfers[{i}].dst", offset, world - 1),
                    wire_int(t.get("buffer"), f"transfers[{i}].buffer", -1, 1),
                    wire_int(t.get("size"), f"transfers[{i}].size", 1, 1 << 48),
                    tuple(pieces),
                )
            )
        return cls(worker, index, sources, offset, world, bucket, specs, tuple(transfers))


_LAST_LOCK = threading.Lock()
_LAST_PARSED: list[tuple[str, PlanPart] | None] = [None]  # the last wire parsed, as JSON text, and its part


@attrs.frozen
class Plan:
    """Every transfer of one update, in execution order (see :mod:`.planning`)."""

    trainer: TrainerLayout
    fleet: FleetLayout
    bucket_bytes: int
    rounds: int
    transfers: tuple[Transfer, ...]

    @property
    def sources(self) -> int:
        return self.trainer.ranks

    @property
    def world_size(self) -> int:
        return self.trainer.ranks + sum(w.world_size for w in self.fleet.workers)

    def group_rank(self, worker: int, rank: int) -> int:
        return self.trainer.ranks + sum(w.world_size for w in self.fleet.workers[:worker]) + rank

    def rank_offset(self, worker: int) -> int:
        return self.group_rank(worker, 0)

    def for_source(self, src: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.src == src)

    def for_worker(self, worker: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.worker == worker)

    def needed_bytes(self, worker: int, rank: int) -> int:
        """Bytes of the plan's tensors that this destination serves."""
        served = self.fleet.workers[worker].served(rank)
        return sum(served[t.spec.name].numel * itemsize(t.spec.dtype) for t in self.trainer.tensors)

    def part(self, worker: int) -> PlanPart:
        """What ``worker`` needs to check and run its side of the plan."""
        w = self.fleet.workers[worker]
        specs = self.trainer.specs
        return PlanPart(
            worker=w.worker,
            index=worker,
            sources=self.sources,
            rank_offset=self.rank_offset(worker),
            world_size=self.world_size,
            bucket_bytes=self.bucket_bytes,
            tensors=specs,
            transfers=self.for_worker(worker),
        )

    def summary(self) -> dict[str, Any]:
        """The ``weightsync plan --json`` object.  ``bytes`` count what travels (a packed
        message's alignment padding included); ``needed_bytes`` what the destination serves."""
        sent = [0] * self.sources
        got: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            n = t.size  # what travels, 64-byte alignment padding included
            sent[t.src] += n
            got[(t.worker, t.rank)] = got.get((t.worker, t.rank), 0) + n
        receivers = [
            {"worker": w, "rank": r, "bytes": got.get((w, r), 0), "needed_bytes": self.needed_bytes(w, r)}
            for w, wl in enumerate(self.fleet.workers)
            for r in range(wl.world_size)
        ]
        return {
            "total_bytes": sum(sent),
            "rounds": self.rounds,
            "transfers": len(self.transfers),
            "senders": [{"rank": s, "bytes": b} for s, b in enumerate(sent)],
            "receivers": receivers,
        }


def fair_share(plan: Plan) -> float:
    """Total bytes over sources: what each link would carry in a perfect balance."""
    return sum(t.size for t in plan.transfers) / max(plan.sources, 1) if plan.transfers else 0.0


def max_sender_share(plan: Plan) -> float:
    """The busiest source's bytes over all bytes sent."""
    s = plan.summary()
    total = s["total_bytes"]
    return max(x["bytes"] for x in s["senders"]) / total if total else 0.0


def receiver_excess(plan: Plan) -> float:
    """Bytes received over bytes needed, summed over every destination rank."""
    s = plan.summary()
    need = sum(r["needed_bytes"] for r in s["receivers"])
    return sum(r["bytes"] for r in s["receivers"]) / need if need else 1.0
