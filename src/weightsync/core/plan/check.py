"""Checking one worker's part of a plan against what that worker really serves, before any
byte of an update moves.  Pure Python.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.boxes import MAX_TILE_PIECES, Box, box_nbytes, overlapping, too_many_pieces
from weightsync.core.plan.value import PlanPart
from weightsync.core.snapshot import TensorSpec


def layout_mismatch(message: str) -> InvalidRequest:
    """The error for layouts (or a plan and a worker) that do not fit together."""
    return InvalidRequest(message, code="layout_mismatch")


def check_part(part: PlanPart, served: Sequence[dict[str, Box]], specs: Sequence[TensorSpec]) -> None:
    """Check one worker's part of a plan against what the worker really serves: ``served[r]``
    is rank ``r``'s box per tensor name, ``specs`` the worker's full tensors.  Every piece must
    name a served tensor with the same dtype and shape, lie inside the box its rank serves,
    have the byte size of its box, sit inside its transfer without overlapping another; the
    pieces of each rank must cover each served box of the plan's tensors exactly once; transfer
    indices are distinct (they are tags).  Raises ``InvalidRequest`` (``layout_mismatch``;
    ``too_many_pieces`` when it cuts a tensor on one rank into more than
    :data:`~weightsync.core.plan.boxes.MAX_TILE_PIECES` pieces).

    The last part that passed is remembered with what it was checked against: the same part
    (the same object, which :meth:`PlanPart.from_wire` gives for the same wire) checked again
    against equal boxes and specs passes without the walk over its pieces."""
    key = (tuple(dict(s) for s in served), tuple(specs))
    with _PASSED_LOCK:
        last = _PASSED[0]
    if last is not None and last[0] is part and last[1] == key:
        return
    _check_part(part, served, specs)
    with _PASSED_LOCK:
        _PASSED[0] = (part, key)


_PASSED_LOCK = threading.Lock()
_PASSED: list[tuple[PlanPart, tuple[tuple[dict[str, Box], ...], tuple[TensorSpec, ...]]] | None] = [None]


def _check_part(part: PlanPart, served: Sequence[dict[str, Box]], specs: Sequence[TensorSpec]) -> None:
    mine = {s.name: s for s in specs}
    for spec in part.tensors:
        if mine.get(spec.name) != spec:
            got = mine.get(spec.name)
            what = f"{got.dtype} {list(got.shape)}" if got else "nothing"
            raise layout_mismatch(
                f"the plan sends {spec.name} as {spec.dtype} {list(spec.shape)}; this worker serves {what}"
            )
    if part.rank_offset + len(served) > part.world_size:
        raise layout_mismatch(f"this worker has {len(served)} ranks, the plan's group has room for fewer")
    if len({t.index for t in part.transfers}) != len(part.transfers):
        raise layout_mismatch("two transfers share an index")
    by_name = {s.name: s for s in part.tensors}
    covered: dict[tuple[int, str], list[Box]] = {}
    for t in part.transfers:
        if t.rank >= len(served):
            raise layout_mismatch(f"transfer {t.index} is for rank {t.rank}; this worker has {len(served)}")
        if t.dst != part.rank_offset + t.rank:
            raise layout_mismatch(
                f"transfer {t.index} goes to group rank {t.dst}, not this worker's rank {t.rank}"
            )
        if t.buffer >= 0 and t.size > part.bucket_bytes:
            raise layout_mismatch(
                f"transfer {t.index}: {t.size} bytes exceed the bucket of {part.bucket_bytes}"
            )
        if t.buffer < 0 and len(t.pieces) != 1:
            raise layout_mismatch(f"transfer {t.index}: an unpacked transfer carries exactly one piece")
        end = 0
        for p in sorted(t.pieces, key=lambda p: p.offset):
            spec = by_name[p.name]
            if p.nbytes != box_nbytes(p.box, spec.dtype) or p.nbytes == 0:
                raise layout_mismatch(
                    f"transfer {t.index}: {p.name} {p.box.to_wire()} is {box_nbytes(p.box, spec.dtype)} bytes, the plan says {p.nbytes}"
                )
            if p.offset < end or p.offset + p.nbytes > t.size:
                raise layout_mismatch(
                    f"transfer {t.index}: {p.name} at {p.offset}+{p.nbytes} overlaps or leaves the {t.size}-byte message"
                )
            end = p.offset + p.nbytes
            box = served[t.rank].get(p.name)
            if box is None or not p.box.within(box):
                raise layout_mismatch(
                    f"transfer {t.index}: rank {t.rank} does not serve {p.name} {p.box.to_wire()}"
                )
            cut = covered.setdefault((t.rank, p.name), [])
            cut.append(p.box)
            if len(cut) > MAX_TILE_PIECES:
                raise too_many_pieces(
                    f"rank {t.rank}: the plan cuts {p.name} into more than {MAX_TILE_PIECES} pieces"
                )
        if t.size != end:
            raise layout_mismatch(f"transfer {t.index}: {t.size} bytes declared, its pieces end at {end}")
    for r, boxes in enumerate(served):
        for spec in part.tensors:
            pieces = covered.get((r, spec.name), [])
            total = sum(b.numel for b in pieces)
            clash = overlapping(pieces)
            mine_box = boxes.get(spec.name)
            wanted = mine_box.numel if mine_box is not None else 0
            if total != wanted or clash is not None:
                why = f" ({clash[0].to_wire()} overlaps {clash[1].to_wire()})" if clash else ""
                raise layout_mismatch(
                    f"rank {r}: the plan's pieces of {spec.name} cover {total} elements{why}; it serves {wanted}"
                )
