"""A transfer plan as data: from a trainer layout and a fleet layout, who sends which box
of which tensor to which worker rank, in which round, packed into which buffer.

:func:`make_plan` is pure and deterministic (the same layouts give the same plan, byte for
byte of its wire form) and cached on its arguments, so a trainer that pushes every step
computes it once, until a layout changes.  How it decides (steps 1-2 in :func:`cut_and_assign`,
3-5 in :func:`order_transfers`):

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
from itertools import pairwise
from typing import Final, TypeAlias

from weightsync.core.dtypes import itemsize
from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.check import layout_mismatch
from weightsync.core.plan.layouts import FleetLayout, Holding, TrainerLayout
from weightsync.core.plan.value import ALIGN, Piece, Plan, Transfer

SPLIT_BYTES: Final = 1 << 20

Cut: TypeAlias = tuple[Box, int, tuple[int, ...]]
"""One piece of a destination's box of one tensor: (box, bytes, candidate sources)."""


class _Cutter:
    """The pieces of served boxes, computed once per distinct (holdings, dtype, served box):
    tensors of the same shape, layout and dtype share their cuts (and the boxes in them),
    which keeps a plan of many like tensors fast and small."""

    def __init__(self, trainer: TrainerLayout, split_bytes: int) -> None:
        self.split_bytes = split_bytes
        kinds: dict[tuple[str, tuple[Holding, ...]], int] = {}
        seen: dict[tuple[str, int], int] = {}  # by the holdings' identity first: shared ones hash once
        self.kind = []
        for t in trainer.tensors:
            k = seen.get((t.spec.dtype, id(t.holdings)))
            if k is None:
                k = seen[(t.spec.dtype, id(t.holdings))] = kinds.setdefault(
                    (t.spec.dtype, t.holdings), len(kinds)
                )
            self.kind.append(k)
        self.first = {k: ti for ti, k in reversed(list(enumerate(self.kind)))}
        self.trainer = trainer
        self.finders: dict[int, _HoldingFinder] = {}
        self.cache: dict[tuple[int, Box], tuple[Cut, ...]] = {}

    def cuts(self, ti: int, need: Box) -> tuple[Cut, ...]:
        key = (self.kind[ti], need)
        got = self.cache.get(key)
        if got is None:
            got = self.cache[key] = self._cut(key[0], need)
        return got

    def _cut(self, kind: int, need: Box) -> tuple[Cut, ...]:
        t = self.trainer.tensors[self.first[kind]]
        finder = self.finders.get(kind)
        if finder is None:
            finder = self.finders[kind] = _HoldingFinder(t.holdings)
        size = itemsize(t.spec.dtype)
        out: list[Cut] = []
        for h in finder.near(need):
            cut = need.intersect(h.box)
            if cut is None:
                continue
            n = cut.numel * size
            if len(h.ranks) > 1 and n >= self.split_bytes:
                out.extend((part, part.numel * size, h.ranks) for part in cut.split(len(h.ranks)))
            else:
                out.append((cut, n, h.ranks))
        return tuple(out)


Items: TypeAlias = tuple[list[int], list[Cut]]
"""The pieces bound for one (source, destination) pair: their tensor indices and cuts."""


def cut_and_assign(
    trainer: TrainerLayout, fleet: FleetLayout, dests: Sequence[tuple[int, int]], split_bytes: int
) -> dict[tuple[int, int], Items]:
    """Steps 1-2: every destination's served box of every tensor cut by the trainer's
    holdings (a piece held by several ranks and of at least ``split_bytes`` cut into up to
    that many parts along its outermost dim), each piece given its source (fixed ones
    first, then the rest largest first, in cutting order among equals, onto the
    least-loaded holder); the pieces by (source, destination), in tensor then box order."""
    cutter = _Cutter(trainer, split_bytes)
    load = [0] * trainer.ranks
    rows: list[list[Items | None]] = []  # per destination, per source
    free: list[tuple[int, int, int, int, Cut]] = []  # -bytes, order, destination, tensor, cut
    names = [t.spec.name for t in trainer.tensors]
    for d, (w, r) in enumerate(dests):
        wl = fleet.workers[w]
        served = dict(zip((s.name for s in wl.tensors), wl.serves[r], strict=True))
        row: list[Items | None] = [None] * trainer.ranks
        rows.append(row)
        for ti, name in enumerate(names):
            for c in cutter.cuts(ti, served[name]):
                ranks = c[2]
                if len(ranks) == 1:
                    s = ranks[0]
                    load[s] += c[1]
                    items = row[s]
                    if items is None:
                        items = row[s] = ([], [])
                    items[0].append(ti)
                    items[1].append(c)
                else:
                    free.append((-c[1], len(free), d, ti, c))
    free.sort()
    for _, _, d, ti, c in free:
        pick = min(c[2], key=lambda k: (load[k], k))
        load[pick] += c[1]
        items = rows[d][pick]
        if items is None:
            items = rows[d][pick] = ([], [])
        items[0].append(ti)
        items[1].append((c[0], c[1], (pick,)))
    pairs = {(s, d): items for d, row in enumerate(rows) for s, items in enumerate(row) if items is not None}
    for tis, cuts in pairs.values():
        if any(a >= b for a, b in pairwise(tis)):
            order = sorted(range(len(tis)), key=lambda i: (tis[i], cuts[i][0].bounds))
            tis[:], cuts[:] = [tis[i] for i in order], [cuts[i] for i in order]
    return pairs


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
    pairs: dict[tuple[int, int], Items],
    bucket_bytes: int,
    direct: int,
) -> tuple[int, tuple[Transfer, ...]]:
    """Steps 3-5: the number of rounds and every transfer, in execution order."""
    M = trainer.ranks
    rounds = max(M, len(dests))
    names = [t.spec.name for t in trainer.tensors]
    flips = [0] * len(dests)
    transfers: list[Transfer] = []
    for rnd, s, d in sorted(((d - s) % rounds, s, d) for s, d in pairs):
        w, r = dests[d]
        for size, pieces in _pack(names, pairs.pop((s, d)), bucket_bytes, direct):
            if size < 0:
                buffer, size = -1, -size
            else:
                buffer, flips[d] = flips[d] % 2, flips[d] + 1
            transfers.append(Transfer(len(transfers), rnd, s, w, r, M + d, buffer, size, pieces))
    return rounds, tuple(transfers)


def _pack(
    names: Sequence[str], items: Items, bucket_bytes: int, direct: int
) -> list[tuple[int, tuple[Piece, ...]]]:
    """Pieces in order as messages ``(size, pieces)``: alone when at least ``direct`` bytes
    (size negated, to mark it), else packed 64-byte aligned into at most ``bucket_bytes``."""
    out: list[tuple[int, tuple[Piece, ...]]] = []
    packed: list[Piece] = []
    used = 0
    for ti, (box, n, _) in zip(*items, strict=True):
        if n >= direct:
            out.append((-n, (Piece(names[ti], box, 0, n),)))
            continue
        start = -(-used // ALIGN) * ALIGN
        if packed and start + n > bucket_bytes:
            out.append((used, tuple(packed)))
            packed, start = [], 0
        packed.append(Piece(names[ti], box, start, n))
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
    pairs = cut_and_assign(trainer, fleet, dests, split_bytes)
    rounds, transfers = order_transfers(trainer, dests, pairs, bucket_bytes, min(DIRECT_BYTES, bucket_bytes))
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
