"""One rank's model: its part of every weight, its K/V cache and kept prefix blocks.

Without tensor parallelism there is one rank holding everything.  With it, every rank
(rank 0 in the serving process, the others in their own processes) builds the same seeded
model and keeps only its part (:mod:`.tp_layout`).  Weights arrive as full tensors
(:meth:`RankModel.load_full` takes this rank's part) or already sliced
(:meth:`RankModel.load_slice`, checked against the layout), into the served weights or into a
staging copy that :meth:`RankModel.swap` serves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightsync.core.errors import InvalidRequest
from weightsync.engines.reference.model import CausalLM, Lora, ModelConfig, Reduce
from weightsync.engines.reference.prefix_cache import BLOCK
from weightsync.engines.reference.tp_layout import FULL, Part, part_of, take
from weightsync.transports.hashing import tensor_hashes


class RankModel:
    """Rank ``rank`` of ``size`` (see the module docstring); ``reduce`` sums over the ranks."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        slots: int,
        rank: int = 0,
        size: int = 1,
        reduce: Reduce | None = None,
        hash_initial: bool = False,
    ) -> None:
        self.model = CausalLM(config, slots=slots)
        self.rank, self.size = rank, size
        full = self.model.weights()
        self.full_shapes = {n: tuple(t.shape) for n, t in full.items()}
        # The seeded weights' hashes, as full logical tensors, before any rank drops its share.
        self.initial_hashes = tensor_hashes(full.items()) if hash_initial else None
        self.parts: dict[str, Part] = {n: part_of(n, s, rank, size) for n, s in self.full_shapes.items()}
        if size > 1:
            assert reduce is not None
            self.model.shard(self.parts, size, reduce)
        self.blocks: dict[int, torch.Tensor] = {}
        self.staging: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ steps and blocks

    def forward(
        self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, lora: Lora | None = None
    ) -> torch.Tensor:
        return self.model.forward_slots(tokens, slots, start, lora)

    def save_block(self, block: int, slot: int, n: int) -> None:
        self.blocks[block] = self.model.read_block(slot, n, BLOCK)

    def load_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        self.model.copy_slot_prefix(slot, [self.blocks[b] for b in blocks], BLOCK)

    def free_blocks(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.blocks.pop(b, None)

    # ------------------------------------------------------------------ weights

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's part of every served weight, by name."""
        return self.model.weights()

    def targets(self, staged: bool) -> dict[str, torch.Tensor]:
        """Where a load writes: the served weights, or the staging copy (:meth:`stage` first)."""
        if not staged:
            return self.weights()
        assert self.staging is not None, "stage() before a staged load"
        return self.staging

    def stage(self) -> None:
        """Start a staging copy of this rank's weights."""
        self.staging = {n: t.clone() for n, t in self.weights().items()}

    def swap(self) -> None:
        """Serve the staging copy."""
        assert self.staging is not None
        with torch.no_grad():
            for name, param in self.weights().items():
                param.data = self.staging[name]
        self.staging = None

    def drop(self) -> None:
        self.staging = None

    def load_full(self, name: str, tensor: torch.Tensor, *, staged: bool = False) -> None:
        """Write this rank's part of the full tensor ``name``."""
        part = self.parts[name]
        self.load_slice(name, take(tensor.reshape(self.full_shapes[name]), part), part, staged=staged)

    def load_slice(self, name: str, tensor: torch.Tensor, part: Part, *, staged: bool = False) -> None:
        """Write ``tensor``, the ``part`` of weight ``name`` (``"full"`` or ``(dim, start,
        length)``), which must be exactly the part this rank serves.  Casts to the weight's
        dtype.  Raises ``InvalidRequest`` (``shard_mismatch``) for any other part or shape,
        writing nothing."""
        own = self.parts.get(name)
        if own is None:
            raise InvalidRequest(f"unknown tensor {name!r}", code="unknown_tensor")
        target = self.targets(staged)[name]
        if (own if own == FULL else tuple(own)) != (part if part == FULL else tuple(part)) or tuple(
            tensor.shape
        ) != tuple(target.shape):
            raise InvalidRequest(
                f"{name}: rank {self.rank}/{self.size} serves {own} of shape {list(target.shape)}, "
                f"got {part} of shape {list(tensor.shape)}",
                code="shard_mismatch",
            )
        with torch.no_grad():
            target.copy_(tensor)
