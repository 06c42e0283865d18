"""The messages of a transfer plan and one worker's part of it, as data with a wire form.

A :class:`Transfer` is one point-to-point message carrying :class:`Piece` s (boxes of
tensors at offsets in its buffer); a :class:`PlanPart` is what one worker receives, from
whom, and where it goes: what a trainer sends each worker before an update, and what the
worker checks (:func:`~.plan_check.check_part`) before any byte moves.  Pure Python.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Final

import attrs

from weightsync.core.boxes import Box
from weightsync.core.layout_wire import (
    MAX_RANKS,
    MAX_TENSORS,
    bad_layout,
    spec_from_wire,
    wire_int,
    wire_list,
    wire_object,
)
from weightsync.core.values import TensorSpec

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
