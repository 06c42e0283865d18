"""The sink a tensor-parallel reference engine loads through: the full logical weights of a
:class:`~weightsync.engines.reference.tp_runner.TPRunner`, scattered to its ranks (the runner
hands it its ``scatter``, so this module needs nothing of the runner's)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

import torch

from weightsync.core.snapshot import TensorSpec
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.sink import Target

Scatter = Callable[[str, torch.Tensor, bool], None]
"""Sends every rank its slice of a full tensor (``TPRunner.scatter``): name, tensor, staged."""


class ShardSink:
    """A sink over the full logical weights of a runner: each tensor handed over is cast to the
    served dtype, hashed as the full tensor it is, and scattered (every rank keeps only its
    slice).  It lends no buffer: readers use their own.  ``staged`` says whether the ranks
    stage what they receive (a load that can still be undone) or write it in place."""

    def __init__(
        self, scatter: Scatter, shapes: dict[str, tuple[int, ...]], dtype: str, staged: bool
    ) -> None:
        self.scatter, self.staged = scatter, staged
        self.dtype = getattr(torch, dtype)
        self.shapes = shapes
        self.specs = {n: TensorSpec(n, dtype, s) for n, s in shapes.items()}
        self.hashes: dict[str, str] = {}
        self.written: list[str] = []
        self.wrote = False
        self.tensors = 0
        self.bytes = 0

    def fill(self, stream: Callable[[Target], Iterator[None]]) -> None:
        """Run a validated reader's ``stream`` to its end, into this sink."""
        for _ in stream(self):
            pass

    def buffer(self, spec: TensorSpec, device: torch.device) -> torch.Tensor | None:
        return None

    def accept(self, spec: TensorSpec, tensor: torch.Tensor, digest: str | None) -> None:
        full = tensor.reshape(self.shapes[spec.name]).to(self.dtype)
        self.write(spec.name, full)
        if digest is not None:  # a cast tensor's hash is that of what it became
            self.hashes[spec.name] = digest if tensor.dtype == self.dtype else tensor_hash(full)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.wrote = True
        self.scatter(name, tensor.reshape(self.shapes[name]), self.staged)
        self.written.append(name)
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()

    def hashed_in_place(self, vouched: Collection[str]) -> bool:
        """Never: the ranks' memory holds slices, so no hash was taken where the weights live."""
        return False

    def written_hashes(self) -> dict[str, str] | None:
        """The hash of every tensor written, or ``None`` when one was not hashed."""
        if any(name not in self.hashes for name in self.written):
            return None
        return {name: self.hashes[name] for name in self.written}
