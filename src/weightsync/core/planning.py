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

import functools
from typing import Final

from weightsync.core.errors import InvalidRequest
from weightsync.core.plan_check import layout_mismatch
from weightsync.core.plan_part import ALIGN
from weightsync.core.plan_pieces import SPLIT_BYTES, assign_sources, cut_pieces
from weightsync.core.plan_rounds import DIRECT_BYTES, order_transfers
from weightsync.core.plan_value import Plan
from weightsync.core.trainer_layout import TrainerLayout
from weightsync.core.worker_layout import FleetLayout

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
