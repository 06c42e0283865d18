"""The hash of each tensor a worker rank serves, taken as a plan's pieces land: the digest a
worker reports is that of what it serves, without a second pass over its memory where the
pieces allow it."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from weightsync.core.plan.value import Piece
from weightsync.transports.hashing import tensor_hash


class Streams:
    """A streaming xxh3-64 of each tensor a rank serves, fed by its pieces as they land
    (while their bytes are still in cache), so that a tensor that arrived in pieces needs no
    second pass over its memory.  A piece that lands ahead of the bytes before it waits and
    is fed from the tensor's memory once they are in.  :meth:`result` is the hash of a
    tensor whose pieces fed its stream exactly once each, in order, without a gap, from the
    first byte to the last; ``None`` for any other (a piece that is not one run, pieces that
    overlap or leave a gap): such a tensor must be hashed whole."""

    def __init__(self) -> None:
        # name -> (stream, bytes fed so far, runs landed ahead: start -> length); None once
        # the tensor cannot be streamed.
        self.state: dict[str, tuple[xxhash.xxh3_64, list[int], dict[int, int]] | None] = {}

    def broken(self, name: str) -> None:
        self.state[name] = None

    def feed(self, name: str, flat: np.ndarray, start: int, nbytes: int) -> None:
        """The piece of ``name`` at bytes ``start .. start + nbytes`` of ``flat`` (the whole
        tensor's bytes) has landed."""
        if name not in self.state:
            self.state[name] = (xxhash.xxh3_64(), [0], {})
        state = self.state[name]
        if state is None:
            return
        h, fed, ahead = state
        if start != fed[0]:
            if start < fed[0] or start in ahead:  # overlaps what was fed or landed
                self.state[name] = None
            else:
                ahead[start] = nbytes
            return
        h.update(flat[start : start + nbytes])
        fed[0] += nbytes
        while fed[0] in ahead:  # pieces that landed ahead of this one, now in order
            n = ahead.pop(fed[0])
            h.update(flat[fed[0] : fed[0] + n])
            fed[0] += n

    def result(self, name: str, nbytes: int) -> str | None:
        state = self.state.get(name)
        if state is None or state[1][0] != nbytes or state[2]:
            return None
        return state[0].hexdigest()


def completed_hash(
    t: torch.Tensor, pieces: int, last: Piece, digest: bytes, streams: Streams, hasher: ThreadPoolExecutor
) -> str | Future[str]:
    """The hash of tensor ``t`` now that ``last``, the last of its ``pieces``, has landed
    (hashed ``digest``): that piece's own when it was the only one and covers all of ``t``
    (the same bytes, hashed once); the :class:`Streams` hash when its pieces fed ``streams``
    in order as they landed; else ``t`` hashed whole on ``hasher`` (a helper thread), while
    the rest of the plan is still arriving."""
    if pieces == 1 and last.box.shape == tuple(t.shape) and t.is_contiguous():
        return digest.hex()
    streamed = streams.result(last.name, t.numel() * t.element_size())
    return streamed if streamed is not None else hasher.submit(tensor_hash, t)
