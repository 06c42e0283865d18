"""A transfer plan as a value: every transfer of one update in execution order, the group ranks it
runs on, each worker's part, and the figures that say how well it balances.
:func:`~weightsync.core.plan.build.make_plan` builds it.  Pure Python.

A :class:`Transfer` is one point-to-point message carrying :class:`Piece` s (boxes of tensors);
a :class:`PlanPart` is one worker's part of a plan, with a wire form.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Final

import attrs

from weightsync.core.dtypes import itemsize
from weightsync.core.plan.boxes import (
    MAX_DIMS,
    MAX_RANKS,
    MAX_TENSORS,
    Box,
    bad_layout,
    spec_from_wire,
    wire_int,
    wire_ints,
    wire_list,
    wire_object,
)
from weightsync.core.plan.layouts import FleetLayout, TrainerLayout
from weightsync.core.snapshot import TensorSpec

ALIGN: Final = 64
PART_FORMAT: Final = "weightsync.plan_part/2"
PART_FORMAT_V1: Final = "weightsync.plan_part/1"


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

    def to_wire(self, compact: bool = True) -> dict[str, Any]:
        """The part's JSON object: :data:`PART_FORMAT` (each transfer's pieces as three flat
        integer lists: tensor indices, offsets, box bounds) or, with ``compact=False``,
        :data:`PART_FORMAT_V1` (an object per piece, its tensor by name)."""
        head = {
            "format": PART_FORMAT if compact else PART_FORMAT_V1,
            "worker": self.worker,
            "index": self.index,
            "sources": self.sources,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in self.tensors],
        }
        at = {s.name: i for i, s in enumerate(self.tensors)}
        transfers = []
        for t in self.transfers:
            wire: dict[str, Any] = {
                "index": t.index, "round": t.round, "src": t.src, "rank": t.rank, "dst": t.dst,
                "buffer": t.buffer, "size": t.size,
            }  # fmt: skip
            if compact:
                wire["tensor"] = [at[p.name] for p in t.pieces]
                wire["offset"] = [p.offset for p in t.pieces]
                wire["box"] = [x for p in t.pieces for b in p.box.bounds for x in b]
            else:
                wire["pieces"] = [
                    {"name": p.name, "box": p.box.to_wire(), "offset": p.offset, "nbytes": p.nbytes}
                    for p in t.pieces
                ]
            transfers.append(wire)
        return {**head, "transfers": transfers}

    @classmethod
    def from_wire(cls, value: Any) -> PlanPart:
        """Parse (not yet check against a worker: :func:`~.plan_check.check_part`).  Raises
        ``InvalidRequest`` (``invalid_layout``) for anything malformed.

        A trainer posts a worker the same part on every push of a plan: the last part parsed
        is kept with its wire form's exact JSON text, and a wire whose text is the same (a
        ``1.0`` or ``true`` for a ``1`` is not) is that part again, not parsed anew.  Parsed
        for a request (inside :func:`kept_if_accepted`), it is kept only once the request
        was answered ok: a refused one leaves the kept part as it was."""
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
            pending = _PENDING.get()
            if pending is not None:
                pending.append((text, part))
            else:
                _keep(text, part)
        return part

    @classmethod
    def _parse(cls, value: Any) -> PlanPart:
        keys = {"format", "worker", "index", "sources", "rank_offset", "world_size", "bucket_bytes"}
        v = wire_object(value, keys | {"tensors", "transfers"}, "plan")
        form = v.get("format")
        if form not in (PART_FORMAT, PART_FORMAT_V1):
            raise bad_layout(f"format must be {PART_FORMAT!r} or {PART_FORMAT_V1!r}", "format")
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
        if len({s.name for s in specs}) != len(specs):
            raise bad_layout("plan.tensors names a tensor twice", "tensors")
        pieces_of = _compact_pieces if form == PART_FORMAT else _named_pieces
        fields = {"index", "round", "src", "rank", "dst", "buffer", "size"}
        fields |= {"tensor", "offset", "box"} if form == PART_FORMAT else {"pieces"}
        raw = wire_list(v.get("transfers"), "transfers", 1 << 24)
        key = "tensor" if form == PART_FORMAT else "pieces"
        listed = (t.get(key) if isinstance(t, dict) else None for t in raw)
        if sum(len(x) for x in listed if isinstance(x, list)) > MAX_PART_PIECES:  # before any is built
            raise bad_layout(f"plan carries more than {MAX_PART_PIECES} pieces", "transfers")
        transfers = []
        for i, t in enumerate(raw):
            what = f"transfers[{i}]"
            t = wire_object(t, fields, what)
            transfers.append(
                Transfer(
                    wire_int(t.get("index"), f"{what}.index", 0, 1 << 31),
                    wire_int(t.get("round"), f"{what}.round", 0, 2 * MAX_RANKS),
                    wire_int(t.get("src"), f"{what}.src", 0, sources - 1),
                    index,
                    wire_int(t.get("rank"), f"{what}.rank", 0, world - offset - 1),
                    wire_int(t.get("dst"), f"{what}.dst", offset, world - 1),
                    wire_int(t.get("buffer"), f"{what}.buffer", -1, 1),
                    wire_int(t.get("size"), f"{what}.size", 1, 1 << 48),
                    pieces_of(t, specs, what),
                )
            )
        return cls(worker, index, sources, offset, world, bucket, specs, tuple(transfers))


MAX_TRANSFER_PIECES: Final = 1 << 20
"""The most pieces one transfer of a part may carry."""

MAX_PART_PIECES: Final = 1 << 21
"""The most pieces a whole part may carry (about 200 MB parsed; a real part within the default
body limit carries well under it: 232,000 pieces for 1,000 tensors from 64 ranks into TP=8)."""


def _named_pieces(t: dict[str, Any], specs: tuple[TensorSpec, ...], what: str) -> tuple[Piece, ...]:
    """A :data:`PART_FORMAT_V1` transfer's pieces: an object each, its tensor by name."""
    by_name = {s.name: s for s in specs}
    pieces = []
    for j, p in enumerate(wire_list(t.get("pieces"), f"{what}.pieces", MAX_TRANSFER_PIECES)):
        at = f"{what}.pieces[{j}]"
        p = wire_object(p, {"name", "box", "offset", "nbytes"}, at)
        spec = by_name.get(p.get("name"))  # type: ignore[arg-type]
        if spec is None:
            raise bad_layout(f"{at}.name is not one of plan.tensors", at)
        box = Box.from_wire(p.get("box"), spec.shape, f"{at}.box")
        offset = wire_int(p.get("offset"), f"{at}.offset", 0, 1 << 48)
        pieces.append(Piece(spec.name, box, offset, wire_int(p.get("nbytes"), f"{at}.nbytes", 0, 1 << 48)))
    return tuple(pieces)


def _compact_pieces(t: dict[str, Any], specs: tuple[TensorSpec, ...], what: str) -> tuple[Piece, ...]:
    """A :data:`PART_FORMAT` transfer's pieces: ``tensor`` (indices into the part's tensors),
    ``offset`` (one per piece) and ``box`` (each piece's ``start, stop`` per dim of its tensor,
    one after the other).  A piece's byte size follows from its box; equal boxes are checked once
    and are one object."""
    tensor = wire_ints(t.get("tensor"), f"{what}.tensor", 0, len(specs) - 1, MAX_TRANSFER_PIECES)
    offset = wire_ints(t.get("offset"), f"{what}.offset", 0, 1 << 48, MAX_TRANSFER_PIECES)
    flat = wire_ints(t.get("box"), f"{what}.box", 0, 1 << 48, 2 * MAX_DIMS * len(tensor))
    if len(offset) != len(tensor):
        raise bad_layout(f"{what}: {len(tensor)} tensor indices but {len(offset)} offsets", what)
    if len(flat) != 2 * sum(len(specs[k].shape) for k in tensor):
        raise bad_layout(f"{what}.box does not hold a [start, stop] per dim of each piece's tensor", what)
    seen: dict[tuple[Any, ...], tuple[Box, int]] = {}  # (shape, dtype, bounds) -> checked box, bytes
    pieces = []
    at = 0
    for j, (k, off) in enumerate(zip(tensor, offset, strict=True)):
        spec = specs[k]
        n = 2 * len(spec.shape)
        bounds = tuple(zip(flat[at : at + n : 2], flat[at + 1 : at + n : 2], strict=True))
        at += n
        key = (spec.shape, spec.dtype, bounds)
        known = seen.get(key)
        if known is None:
            if any(not s <= e <= d for (s, e), d in zip(bounds, spec.shape, strict=True)):
                raise bad_layout(
                    f"{what}: piece {j}'s box {list(bounds)} is not inside {spec.name} {list(spec.shape)}",
                    what,
                )
            box = Box(bounds)
            known = seen[key] = (box, box.numel * itemsize(spec.dtype))
        pieces.append(Piece(spec.name, known[0], off, known[1]))
    return tuple(pieces)


_LAST_LOCK = threading.Lock()
_LAST_PARSED: list[tuple[str, PlanPart] | None] = [None]  # the last wire parsed, as JSON text, and its part
_PENDING: ContextVar[list[tuple[str, PlanPart]] | None] = ContextVar("weightsync_plan_parts", default=None)


def _keep(text: str, part: PlanPart) -> None:
    with _LAST_LOCK:
        _LAST_PARSED[0] = (text, part)


@contextlib.contextmanager
def kept_if_accepted() -> Iterator[None]:
    """A request's scope: a part :meth:`PlanPart.from_wire` parses inside it (in this context,
    or a thread started from it with a copy of the context, as ``asyncio.to_thread`` does) is
    kept for the next wire of the same text only when the block ends without an exception.  A
    refused request so leaves no parse of its own behind, and the part an accepted one left
    stays kept."""
    pending: list[tuple[str, PlanPart]] = []
    token = _PENDING.set(pending)
    try:
        yield
    finally:
        _PENDING.reset(token)
    if pending:  # reached only when the block raised nothing
        _keep(*pending[-1])


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
