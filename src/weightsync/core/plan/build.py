"""A transfer plan as data: from a trainer layout and a fleet layout, who sends which box
of which tensor to which worker rank, in which round, packed into which buffer.

:func:`make_plan` is pure and deterministic (the same layouts give the same plan, byte for
byte of its wire form) and cached on its arguments, so a trainer that pushes every step
computes it once, until a layout changes.  How it decides (steps 1-2 in :mod:`.plan_pieces`,
3-5 in :mod:`.plan_rounds`):

1. **Pieces.** For every destination rank (worker ``w``, rank ``r``) and every tensor, the
   box it serves is intersected with each trainer holding of that tensor; each non-empty
   intersection is one piece.  The holdings tile the tensor and the pieces are cut from the
   served box, so every element a destination serves arrives exactly once and nothing it
   does not serve is sent (no fallback tensors in this planner: every served box is exact).
2. **Sources.** A piece held by one rank comes from that rank.  A piece held by several
   (replicated or HSDP tensors) is first cut into up to that many parts along its outermost
   dim (when it is at least ``split_bytes``), then every part goes, largest first, to the
   least-loaded holder (LPT): the busiest source link ends close to its fair share.
3. **Rounds.** Destinations are numbered in fleet order (``d``) and sources ``s``; the pair
   ``(s, d)`` runs in round ``(d - s) mod max(M, D)``: in one round every source sends to
   a different destination and every destination hears from at most one source, so all
   links are busy at once and none is shared by two flows of the same round.
4. **Buffers.** A pair's pieces, in tensor order, are packed (64-byte aligned) into
   transfers of at most ``bucket_bytes``; a piece of at least ``min(DIRECT_BYTES,
   bucket_bytes)`` travels alone (``buffer == -1``: received straight into place when its
   box is contiguous in the destination's shard).  Packed transfers alternate between the
   destination's two buffers (0 and 1).
5. **Order.** Transfers are ordered by (round, source, destination, position), and that
   index is also each transfer's point-to-point tag.  Every rank works through its own
   transfers in this one global order, so the earliest unfinished transfer always has both
   ends posted: no window of in-flight operations can deadlock.

Group ranks: trainer rank ``s`` is group rank ``s``; worker ``w``'s rank ``r`` is group rank
``M + (ranks of the workers before w) + r``.

A piece's bytes are its box's elements in row-major order (see :mod:`.boxes`);
:meth:`Box.runs` lists the byte ranges of the full tensor they are.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import Final, TypeAlias

from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.boxes import Box, box_nbytes
from weightsync.core.plan.check import layout_mismatch
from weightsync.core.plan.layouts import FleetLayout, Holding, TrainerLayout
from weightsync.core.plan.value import ALIGN, Piece, Plan, Transfer
from weightsync.core.snapshot import TensorSpec

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


DIRECT_BYTES: Final = 4 << 20


def order_transfers(
    trainer: TrainerLayout,
    dests: Sequence[tuple[int, int]],
    raw: Sequence[RawPiece],
    src: Sequence[int],
    bucket_bytes: int,
    direct: int,
) -> tuple[int, tuple[Transfer, ...]]:
    """The number of rounds and every transfer, in execution order, for the pieces ``raw``
    sent from ``src``."""
    M = trainer.ranks
    # 3-4. per (source, destination) pair, in tensor order, packed into transfers
    rounds = max(M, len(dests))
    pairs: dict[tuple[int, int], list[int]] = {}
    for i in range(len(raw)):
        pairs.setdefault((src[i], raw[i][0]), []).append(i)
    staged: list[tuple[int, int, int, int, int, tuple[Piece, ...]]] = []  # round, s, d, pos, size, pieces
    for (s, d), items in pairs.items():
        items.sort(key=lambda i: (raw[i][1], raw[i][2].bounds))
        cuts = [(trainer.tensors[raw[i][1]].spec, raw[i][2]) for i in items]
        for pos, (size, packed) in enumerate(_pack(cuts, bucket_bytes, direct)):
            staged.append(((d - s) % rounds, s, d, pos, size, packed))
    # 5. one global order; buffers alternate per destination
    staged.sort(key=lambda x: (x[0], x[1], x[2], x[3]))
    flips = [0] * len(dests)
    group_rank = list(range(M, M + len(dests)))  # destinations in fleet order follow the sources
    transfers = []
    for index, (rnd, s, d, _, size, pieces) in enumerate(staged):
        w, r = dests[d]
        if size < 0:
            buffer, size = -1, -size
        else:
            buffer, flips[d] = flips[d] % 2, flips[d] + 1
        transfers.append(Transfer(index, rnd, s, w, r, group_rank[d], buffer, size, pieces))
    return rounds, tuple(transfers)


def _pack(
    pieces: Sequence[tuple[TensorSpec, Box]], bucket_bytes: int, direct: int
) -> list[tuple[int, tuple[Piece, ...]]]:
    """Pieces in order as messages ``(size, pieces)``: alone when at least ``direct`` bytes
    (size negated, to mark it), else packed 64-byte aligned into at most ``bucket_bytes``."""
    out: list[tuple[int, tuple[Piece, ...]]] = []
    packed: list[Piece] = []
    used = 0
    for spec, box in pieces:
        n = box_nbytes(box, spec.dtype)
        if n >= direct:
            out.append((-n, (Piece(spec.name, box, 0, n),)))
            continue
        start = -(-used // ALIGN) * ALIGN
        if packed and start + n > bucket_bytes:
            out.append((used, tuple(packed)))
            packed, start = [], 0
        packed.append(Piece(spec.name, box, start, n))
        used = start + n
    if packed:
        out.append((used, tuple(packed)))
    return out


DEFAULT_BUCKET_BYTES: Final = 32 << 20


@functools.lru_cache(maxsize=32)
def make_plan(
    trainer: TrainerLayout,
    fleet: FleetLayout,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    split_bytes: int = SPLIT_BYTES,
) -> Plan:
    """The plan that moves ``trainer``'s tensors into what each rank of ``fleet`` serves.

    Raises ``InvalidRequest`` (``layout_mismatch``) when a worker does not serve one of the
    trainer's tensors, or serves it with another dtype or full shape; (``invalid_value``)
    for a ``bucket_bytes`` below 64 bytes."""
    if type(bucket_bytes) is not int or bucket_bytes < ALIGN:
        raise InvalidRequest(
            f"bucket_bytes must be at least {ALIGN}", code="invalid_value", field="bucket_bytes"
        )
    _check_served(trainer, fleet)
    dests = [(w, r) for w, wl in enumerate(fleet.workers) for r in range(wl.world_size)]
    raw = cut_pieces(trainer, fleet, dests, split_bytes)
    src = assign_sources(trainer, raw)
    rounds, transfers = order_transfers(
        trainer, dests, raw, src, bucket_bytes, min(DIRECT_BYTES, bucket_bytes)
    )
    return Plan(trainer, fleet, bucket_bytes, rounds, transfers)


def _check_served(trainer: TrainerLayout, fleet: FleetLayout) -> None:
    for wl in fleet.workers:
        theirs = {s.name: s for s in wl.tensors}
        for spec in trainer.specs:
            mine = theirs.get(spec.name)
            if mine is None:
                raise layout_mismatch(f"worker {wl.worker} does not serve {spec.name!r}")
            if mine != spec:
                raise layout_mismatch(
                    f"{spec.name}: the trainer holds {spec.dtype} {list(spec.shape)}, worker {wl.worker} "
                    f"serves {mine.dtype} {list(mine.shape)}"
                )
