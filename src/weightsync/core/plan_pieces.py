"""Steps 1 and 2 of a transfer plan (:mod:`.planning`): cut what every destination rank
serves into pieces, one per trainer holding it meets, then choose each piece's source: the
one holder, or, for a piece held by several, the least-loaded holder, largest pieces first
(LPT).  Pure Python."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Final, TypeAlias

from weightsync.core.boxes import Box, box_nbytes
from weightsync.core.trainer_layout import Holding, TrainerLayout
from weightsync.core.worker_layout import FleetLayout

SPLIT_BYTES: Final = 1 << 20

RawPiece: TypeAlias = tuple[int, int, Box, tuple[int, ...]]
"""(destination index, tensor index, box, candidate sources)."""


def cut_pieces(
    trainer: TrainerLayout, fleet: FleetLayout, dests: Sequence[tuple[int, int]], split_bytes: int
) -> list[RawPiece]:
    """Every destination's served box of every tensor cut by the trainer's holdings; a
    piece held by several ranks and of at least ``split_bytes`` is cut into up to that many
    parts along its outermost dim."""
    raw: list[RawPiece] = []
    finders = [_HoldingFinder(t.holdings) for t in trainer.tensors]
    for d, (w, r) in enumerate(dests):
        served = fleet.workers[w].served(r)
        for ti, t in enumerate(trainer.tensors):
            need = served[t.spec.name]
            for h in finders[ti].near(need):
                cut = need.intersect(h.box)
                if cut is None:
                    continue
                if len(h.ranks) > 1 and box_nbytes(cut, t.spec.dtype) >= split_bytes:
                    raw.extend((d, ti, part, h.ranks) for part in cut.split(len(h.ranks)))
                else:
                    raw.append((d, ti, cut, h.ranks))
    return raw


def assign_sources(trainer: TrainerLayout, raw: Sequence[RawPiece]) -> list[int]:
    """The source rank of each piece of ``raw``: fixed ones first, then the rest largest
    first onto the least-loaded holder."""
    load = [0] * trainer.ranks
    src: list[int] = [-1] * len(raw)
    for i, (_, ti, box, ranks) in enumerate(raw):
        if len(ranks) == 1:
            src[i] = ranks[0]
            load[ranks[0]] += box_nbytes(box, trainer.tensors[ti].spec.dtype)
    free = [i for i, (_, _, _, ranks) in enumerate(raw) if len(ranks) > 1]
    free.sort(key=lambda i: (-box_nbytes(raw[i][2], trainer.tensors[raw[i][1]].spec.dtype), i))
    for i in free:
        ranks = raw[i][3]
        pick = min(ranks, key=lambda k: (load[k], k))
        src[i] = pick
        load[pick] += box_nbytes(raw[i][2], trainer.tensors[raw[i][1]].spec.dtype)
    return src


class _HoldingFinder:
    """The holdings a box may meet: when the holdings are slices along one dim (FSDP, TP),
    only those whose interval on it overlaps the box's, found by bisection."""

    def __init__(self, holdings: tuple[Holding, ...]) -> None:
        self.holdings = holdings
        self.dim: int | None = None
        if len(holdings) > 8:
            first = holdings[0].box.bounds
            differ = {d for h in holdings for d, b in enumerate(h.box.bounds) if b != first[d]}
            if len(differ) == 1:
                self.dim = differ.pop()
                self.sorted = sorted(holdings, key=lambda h: h.box.bounds[self.dim or 0])
                self.starts = [h.box.bounds[self.dim][0] for h in self.sorted]

    def near(self, box: Box) -> Sequence[Holding]:
        if self.dim is None:
            return self.holdings
        lo, hi = box.bounds[self.dim]
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        j = bisect.bisect_left(self.starts, hi)
        return self.sorted[i:j]
