"""What the reference engine asks of its model: a :class:`Runner`.

The scheduler and the engine adapter never touch the model's tensors; they run steps,
keep and restore prefix blocks, and load or hash weights through a runner.  Two exist:
:class:`LocalRunner` (one process, this module) and
:class:`~weightsync.engines.reference.tp_runner.TPRunner` (tensor parallelism: rank 0
drives the other ranks).  Whichever runs, the weights are described, loaded and hashed as
the full logical tensors the one-process engine has.

Every method is blocking: the engine calls them from a thread, one at a time (it holds its
step lock, or runs a load that only touches a staging copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from weightsync.core.snapshot import WeightInfo
from weightsync.engines.reference.model import Lora, ModelConfig
from weightsync.engines.reference.prefix_cache import BlockStore
from weightsync.engines.reference.rank import RankModel
from weightsync.engines.reference.tp_layout import Part
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.sink import TensorSink, weight_info


class Runner(BlockStore, Protocol):
    """The model behind the reference engine (see the module docstring)."""

    slots: int
    initial_hashes: dict[str, str]  # of the seeded weights it started with, as full tensors
    layout: list[dict[str, Part]]  # per rank, what it serves (see tp_layout.tp_layout)

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """:meth:`CausalLM.forward_slots`: last-position logits [B, V] (float32).  A runner that
        serves LoRA adapters (:class:`LocalRunner`) takes the rows' adapters as a fourth
        argument."""
        ...

    def weight_info(self) -> WeightInfo:
        """Names, dtypes and full logical shapes of the served weights."""
        ...

    def sink(self, staged: bool) -> TensorSink:
        """A sink for a load: into the served weights, or (``staged``) into a fresh staging
        copy that :meth:`swap_staged` serves or :meth:`drop_staged` discards."""
        ...

    def swap_staged(self) -> None:
        """Serve the staging copy (call it holding the step lock)."""
        ...

    def drop_staged(self) -> None:
        """Discard the staging copy, if any."""
        ...

    def hashes(self) -> dict[str, str]:
        """``name -> xxh3-64`` of every served weight, as full logical tensors."""
        ...

    def alive(self) -> bool:
        """Whether the runner can still run steps (a cheap check)."""
        ...

    def check(self) -> None:
        """Raises ``EngineFailure`` when the runner can no longer run steps."""
        ...

    def close(self) -> None:
        """Release what the runner holds (processes, groups); idempotent."""
        ...


class LocalRunner:
    """A :class:`Runner` over one in-process model (no tensor parallelism)."""

    def __init__(self, config: ModelConfig, *, slots: int = 8) -> None:
        self.rank = RankModel(config, slots=slots, hash_initial=True)
        self.model = self.rank.model
        self.slots = slots
        assert self.rank.initial_hashes is not None
        self.initial_hashes = self.rank.initial_hashes
        self.layout: list[dict[str, Part]] = [dict(self.rank.parts)]

    def forward(
        self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, lora: Lora | None = None
    ) -> torch.Tensor:
        return self.rank.forward(tokens, slots, start, lora)

    @torch.no_grad()
    def full_logits(self, tokens: list[int], lora: Lora | None = None) -> torch.Tensor:
        """Logits [T, V] (float32) at every position of ``tokens``, without the cache (for
        prompt logprobs; only the one-process runner has them), with ``lora``'s adapter."""
        return self.model.forward_full(torch.tensor([tokens]), lora)[0].float()

    def save_block(self, block: int, slot: int, n: int) -> None:
        self.rank.save_block(block, slot, n)

    def load_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        self.rank.load_blocks(slot, blocks)

    def free_blocks(self, blocks: Sequence[int]) -> None:
        self.rank.free_blocks(blocks)

    def weight_info(self) -> WeightInfo:
        return weight_info(self.model.weights().items())

    def sink(self, staged: bool) -> TensorSink:
        if staged:
            self.rank.stage()
        return TensorSink(self.rank.targets(staged))

    def swap_staged(self) -> None:
        self.rank.swap()

    def drop_staged(self) -> None:
        self.rank.drop()

    def hashes(self) -> dict[str, str]:
        return tensor_hashes(self.model.weights().items())

    def alive(self) -> bool:
        return True

    def check(self) -> None:
        pass

    def close(self) -> None:
        self.rank.blocks.clear()
        self.rank.drop()
