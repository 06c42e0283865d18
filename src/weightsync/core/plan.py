"""A transfer plan as data: from a trainer layout and a fleet layout, who sends which box
of which tensor to which worker rank, in which round, packed into which buffer.

:func:`make_plan` is pure and deterministic (the same layouts give the same plan, byte for
byte of its wire form) and cached on its arguments, so a trainer that pushes every step
computes it once, until a layout changes.  How it decides:

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

A piece's bytes are its box's elements in row-major order (see :mod:`.layout`);
:meth:`Box.runs` lists the byte ranges of the full tensor they are.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import Any, Final

import attrs

from .dtypes import itemsize
from .errors import InvalidRequest
from .layout import (
    MAX_RANKS,
    MAX_TENSORS,
    Box,
    FleetLayout,
    Holding,
    TrainerLayout,
    _check_keys,
    _int,
    _list,
    overlapping,
)
from .values import TensorSpec

ALIGN: Final = 64
DIRECT_BYTES: Final = 4 << 20
DEFAULT_BUCKET_BYTES: Final = 32 << 20
SPLIT_BYTES: Final = 1 << 20
PART_FORMAT: Final = "weightsync.plan_part/1"


def _mismatch(message: str) -> InvalidRequest:
    return InvalidRequest(message, code="layout_mismatch")


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
class Plan:
    """Every transfer of one update, in execution order (see the module docstring)."""

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


def _nbytes(box: Box, dtype: str) -> int:
    return box.numel * itemsize(dtype)


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
    direct = min(DIRECT_BYTES, bucket_bytes)
    M = trainer.ranks
    dests = [(w, r) for w, wl in enumerate(fleet.workers) for r in range(wl.world_size)]
    for wl in fleet.workers:
        theirs = {s.name: s for s in wl.tensors}
        for spec in trainer.specs:
            mine = theirs.get(spec.name)
            if mine is None:
                raise _mismatch(f"worker {wl.worker} does not serve {spec.name!r}")
            if mine != spec:
                raise _mismatch(
                    f"{spec.name}: the trainer holds {spec.dtype} {list(spec.shape)}, worker {wl.worker} "
                    f"serves {mine.dtype} {list(mine.shape)}"
                )
    # 1. pieces per destination: (dest index, tensor index, box, candidate sources)
    raw: list[tuple[int, int, Box, tuple[int, ...]]] = []
    finders = [_HoldingFinder(t.holdings) for t in trainer.tensors]
    for d, (w, r) in enumerate(dests):
        served = fleet.workers[w].served(r)
        for ti, t in enumerate(trainer.tensors):
            need = served[t.spec.name]
            for h in finders[ti].near(need):
                cut = need.intersect(h.box)
                if cut is None:
                    continue
                if len(h.ranks) > 1 and _nbytes(cut, t.spec.dtype) >= split_bytes:
                    raw.extend((d, ti, part, h.ranks) for part in cut.split(len(h.ranks)))
                else:
                    raw.append((d, ti, cut, h.ranks))
    # 2. sources: fixed ones first, then the rest largest first onto the least-loaded holder
    load = [0] * M
    src: list[int] = [-1] * len(raw)
    for i, (_, ti, box, ranks) in enumerate(raw):
        if len(ranks) == 1:
            src[i] = ranks[0]
            load[ranks[0]] += _nbytes(box, trainer.tensors[ti].spec.dtype)
    free = [i for i, (_, _, _, ranks) in enumerate(raw) if len(ranks) > 1]
    free.sort(key=lambda i: (-_nbytes(raw[i][2], trainer.tensors[raw[i][1]].spec.dtype), i))
    for i in free:
        ranks = raw[i][3]
        pick = min(ranks, key=lambda k: (load[k], k))
        src[i] = pick
        load[pick] += _nbytes(raw[i][2], trainer.tensors[raw[i][1]].spec.dtype)
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
    return Plan(trainer, fleet, bucket_bytes, rounds, tuple(transfers))


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


def _pack(
    pieces: Sequence[tuple[TensorSpec, Box]], bucket_bytes: int, direct: int
) -> list[tuple[int, tuple[Piece, ...]]]:
    """Pieces in order as messages ``(size, pieces)``: alone when at least ``direct`` bytes
    (size negated, to mark it), else packed 64-byte aligned into at most ``bucket_bytes``."""
    out: list[tuple[int, tuple[Piece, ...]]] = []
    packed: list[Piece] = []
    used = 0
    for spec, box in pieces:
        n = _nbytes(box, spec.dtype)
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


# ---------------------------------------------------------------------------- one worker's part


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
        """Parse (not yet check against a worker: :func:`check_part`).  Raises
        ``InvalidRequest`` (``invalid_layout``) for anything malformed."""
        from .layout import _bad, _spec_from_wire

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
        v = _check_keys(value, keys, "plan")
        if v.get("format") != PART_FORMAT:
            raise _bad(f"format must be {PART_FORMAT!r}", "format")
        worker = v.get("worker")
        if not isinstance(worker, str):
            raise _bad("plan.worker must be a string", "worker")
        index = _int(v.get("index"), "index", 0, MAX_RANKS)
        sources = _int(v.get("sources"), "sources", 1, MAX_RANKS)
        world = _int(v.get("world_size"), "world_size", 2, 2 * MAX_RANKS)
        offset = _int(v.get("rank_offset"), "rank_offset", sources, world - 1)
        bucket = _int(v.get("bucket_bytes"), "bucket_bytes", ALIGN, 1 << 40)
        specs = tuple(
            _spec_from_wire(s, f"tensors[{i}]")
            for i, s in enumerate(_list(v.get("tensors"), "tensors", MAX_TENSORS))
        )
        by_name = {s.name: s for s in specs}
        if len(by_name) != len(specs):
            raise _bad("plan.tensors names a tensor twice", "tensors")
        transfers = []
        for i, t in enumerate(_list(v.get("transfers"), "transfers", 1 << 24)):
            t = _check_keys(
                t, {"index", "round", "src", "rank", "dst", "buffer", "size", "pieces"}, f"transfers[{i}]"
            )
            pieces = []
            for j, p in enumerate(_list(t.get("pieces"), f"transfers[{i}].pieces", 1 << 20)):
                what = f"transfers[{i}].pieces[{j}]"
                p = _check_keys(p, {"name", "box", "offset", "nbytes"}, what)
                spec = by_name.get(p.get("name"))  # type: ignore[arg-type]
                if spec is None:
                    raise _bad(f"{what}.name is not one of plan.tensors", what)
                box = Box.from_wire(p.get("box"), spec.shape, f"{what}.box")
                pieces.append(
                    Piece(
                        spec.name,
                        box,
                        _int(p.get("offset"), f"{what}.offset", 0, 1 << 48),
                        _int(p.get("nbytes"), f"{what}.nbytes", 0, 1 << 48),
                    )
                )
            transfers.append(
                Transfer(
                    _int(t.get("index"), f"transfers[{i}].index", 0, 1 << 31),
                    _int(t.get("round"), f"transfers[{i}].round", 0, 2 * MAX_RANKS),
                    _int(t.get("src"), f"transfers[{i}].src", 0, sources - 1),
                    index,
                    _int(t.get("rank"), f"transfers[{i}].rank", 0, world - offset - 1),
                    _int(t.get("dst"), f"transfers[{i}].dst", offset, world - 1),
                    _int(t.get("buffer"), f"transfers[{i}].buffer", -1, 1),
                    _int(t.get("size"), f"transfers[{i}].size", 1, 1 << 48),
                    tuple(pieces),
                )
            )
        return cls(worker, index, sources, offset, world, bucket, specs, tuple(transfers))


def check_part(part: PlanPart, served: Sequence[dict[str, Box]], specs: Sequence[TensorSpec]) -> None:
    """Check one worker's part of a plan against what the worker really serves: ``served[r]``
    is rank ``r``'s box per tensor name, ``specs`` the worker's full tensors.  Every piece must
    name a served tensor with the same dtype and shape, lie inside the box its rank serves,
    have the byte size of its box, sit inside its transfer without overlapping another; the
    pieces of each rank must cover each served box of the plan's tensors exactly once; transfer
    indices are distinct (they are tags).  Raises ``InvalidRequest`` (``layout_mismatch``)."""
    mine = {s.name: s for s in specs}
    for spec in part.tensors:
        if mine.get(spec.name) != spec:
            got = mine.get(spec.name)
            what = f"{got.dtype} {list(got.shape)}" if got else "nothing"
            raise _mismatch(
                f"the plan sends {spec.name} as {spec.dtype} {list(spec.shape)}; this worker serves {what}"
            )
    if part.rank_offset + len(served) > part.world_size:
        raise _mismatch(f"this worker has {len(served)} ranks, the plan's group has room for fewer")
    if len({t.index for t in part.transfers}) != len(part.transfers):
        raise _mismatch("two transfers share an index")
    by_name = {s.name: s for s in part.tensors}
    covered: dict[tuple[int, str], list[Box]] = {}
    for t in part.transfers:
        if t.rank >= len(served):
            raise _mismatch(f"transfer {t.index} is for rank {t.rank}; this worker has {len(served)}")
        if t.dst != part.rank_offset + t.rank:
            raise _mismatch(f"transfer {t.index} goes to group rank {t.dst}, not this worker's rank {t.rank}")
        if t.buffer >= 0 and t.size > part.bucket_bytes:
            raise _mismatch(f"transfer {t.index}: {t.size} bytes exceed the bucket of {part.bucket_bytes}")
        if t.buffer < 0 and len(t.pieces) != 1:
            raise _mismatch(f"transfer {t.index}: an unpacked transfer carries exactly one piece")
        end = 0
        for p in sorted(t.pieces, key=lambda p: p.offset):
            spec = by_name[p.name]
            if p.nbytes != _nbytes(p.box, spec.dtype) or p.nbytes == 0:
                raise _mismatch(
                    f"transfer {t.index}: {p.name} {p.box.to_wire()} is {_nbytes(p.box, spec.dtype)} bytes, the plan says {p.nbytes}"
                )
            if p.offset < end or p.offset + p.nbytes > t.size:
                raise _mismatch(
                    f"transfer {t.index}: {p.name} at {p.offset}+{p.nbytes} overlaps or leaves the {t.size}-byte message"
                )
            end = p.offset + p.nbytes
            if not p.box.within(served[t.rank][p.name]):
                raise _mismatch(
                    f"transfer {t.index}: rank {t.rank} does not serve {p.name} {p.box.to_wire()}"
                )
            covered.setdefault((t.rank, p.name), []).append(p.box)
        if t.size != end:
            raise _mismatch(f"transfer {t.index}: {t.size} bytes declared, its pieces end at {end}")
    for r, boxes in enumerate(served):
        for spec in part.tensors:
            pieces = covered.get((r, spec.name), [])
            total = sum(b.numel for b in pieces)
            clash = overlapping(pieces)
            if total != boxes[spec.name].numel or clash is not None:
                why = f" ({clash[0].to_wire()} overlaps {clash[1].to_wire()})" if clash else ""
                raise _mismatch(
                    f"rank {r}: the plan's pieces of {spec.name} cover {total} elements{why}; "
                    f"it serves {boxes[spec.name].numel}"
                )


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
