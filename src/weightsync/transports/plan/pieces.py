"""Where a plan's pieces lie in the tensors a rank holds or serves: as a view of the tensor,
and, when a piece is one run of a plain CPU tensor's bytes, as that run (copied and hashed
as bytes, the cheapest path on both sides of a message)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from weightsync.core.plan.boxes import Box
from weightsync.core.plan.value import Piece
from weightsync.core.snapshot import TensorSpec
from weightsync.transports.sink import torch_dtype


def piece_view(local: torch.Tensor, served: Box, piece: Piece) -> torch.Tensor:
    """The elements of ``piece`` inside ``local`` (a tensor holding box ``served``)."""
    rel = piece.box.relative_to(served)
    return local[tuple(slice(a, b) for a, b in rel.bounds)]


def run_start(shape: Sequence[int], served: Box, box: Box, itemsize: int) -> int | None:
    """Where ``box`` (inside ``served``, the box a contiguous tensor of ``shape`` holds) starts
    in that tensor's bytes, when its elements are one contiguous run of them; else ``None``.
    A box is one run when every dimension before its first longer than one element has one
    element, and every dimension after it is whole."""
    start, stride, whole_after = 0, itemsize, True
    for d in range(len(shape) - 1, -1, -1):
        lo, hi = box.bounds[d]
        o = served.bounds[d][0]
        if not whole_after and hi - lo != 1:
            return None
        if (lo - o, hi - o) != (0, shape[d]):
            whole_after = False
        start += (lo - o) * stride
        stride *= shape[d]
    return start


def flat_bytes(t: torch.Tensor) -> np.ndarray | None:
    """``t``'s memory as flat bytes (a numpy view, no copy) when it is contiguous on the CPU
    and holds plain values (no lazy conjugate or negative view); ``None`` otherwise."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 or t.is_conj() or t.is_neg():
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def message_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes (messages are bytes on both sides)."""
    return t.reshape(-1).view(torch.uint8)


class Runs:
    """Each tensor's bytes (:func:`flat_bytes`, made once per tensor) and where each piece
    lies in them."""

    def __init__(
        self, tensors: Mapping[str, tuple[torch.Tensor, Box]], specs: Mapping[str, TensorSpec]
    ) -> None:
        self.tensors, self.specs = tensors, specs
        self.flat: dict[str, np.ndarray | None] = {}

    def done(self, name: str) -> None:
        """Forget ``name``'s bytes (no more pieces of it will land)."""
        self.flat.pop(name, None)

    def of(self, p: Piece) -> tuple[np.ndarray, int] | None:
        """``(the tensor's bytes, where the piece starts in them)`` when the piece is one run
        of a plain CPU tensor of its spec's dtype; ``None`` otherwise."""
        if p.name not in self.flat:
            t, _ = self.tensors[p.name]
            ok = t.dtype == torch_dtype(self.specs[p.name].dtype)
            self.flat[p.name] = flat_bytes(t) if ok else None
        flat = self.flat[p.name]
        if flat is None:
            return None
        t, served = self.tensors[p.name]
        start = run_start(t.shape, served, p.box, t.element_size())
        if start is None or start + p.nbytes > flat.nbytes:
            return None
        return flat, start
