"""Steps 3 to 5 of a transfer plan (:mod:`.planning`): each (source, destination) pair's
round, its pieces packed into transfers (64-byte aligned, at most a bucket; a large piece
alone), one global order that is also each transfer's tag, and the destination buffers
alternating.  Pure Python."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from weightsync.core.boxes import Box, box_nbytes
from weightsync.core.plan_part import ALIGN, Piece, Transfer
from weightsync.core.plan_pieces import RawPiece
from weightsync.core.trainer_layout import TrainerLayout
from weightsync.core.values import TensorSpec

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
