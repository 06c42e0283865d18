"""The reference engine's memory release (colocated RL): its weights and its K/V really freed,
and restored.

* offload: every served weight is copied into a host-side store (on CPU a separate copy),
  then the served tensors' storage is freed (resized to zero bytes: the tensors keep their
  names, shapes and dtypes, which is what a later load is checked against); restoring
  reallocates the storage and copies the store back, byte for byte.
* discard: the storage is freed and nothing is kept.  Restoring gives the tensors memory
  again (zeros): no version's weights, which is what the state machine keeps saying until
  an update rewrote them all.  A load into freed weights reallocates them first.
* K/V: the slot cache and every cached prefix block are dropped (paused requests that kept
  their K/V recompute it); the slot cache is allocated again, empty, on the next step.

Only the in-process model releases memory; a tensor-parallel engine's ranks live in other
processes and refuse (``not_supported``).
"""

from __future__ import annotations

import asyncio

import torch

from weightsync.core.errors import IllegalState, NotSupported
from weightsync.engines.reference.prefix_cache import PrefixCache
from weightsync.engines.reference.runner import LocalRunner, Runner
from weightsync.engines.reference.scheduler import Scheduler


class ReferenceMemory:
    """Releases and restores the memory of one reference engine's model (see the module docstring)."""

    def __init__(self, runner: Runner, scheduler: Scheduler, cache: PrefixCache) -> None:
        self.runner, self.scheduler, self.cache = runner, scheduler, cache
        self.freed: dict[str, int] = {}  # name -> bytes of storage freed
        self.offloaded: dict[str, torch.Tensor] | None = None

    def _weights(self) -> dict[str, torch.Tensor]:
        if not isinstance(self.runner, LocalRunner):
            raise NotSupported(
                "a tensor-parallel reference engine cannot release its memory", code="not_supported"
            )
        return self.runner.model.weights()

    async def release(self, weights: str | None, kv_cache: bool) -> None:
        """Release ``weights`` (``"offload"``, ``"discard"`` or ``None``) and, with
        ``kv_cache``, the K/V; the caller (the controller) checked that generation is paused."""
        params = self._weights()
        async with self.scheduler.step_lock:
            if kv_cache:
                self.scheduler.forget_kv()
                await asyncio.to_thread(self.cache.clear)
                self.runner.model.kv = None  # type: ignore[attr-defined]
            if weights is not None:
                await asyncio.to_thread(self._free, params, weights == "offload")

    def _free(self, params: dict[str, torch.Tensor], offload: bool) -> None:
        if offload and not self.freed:  # copy everything before freeing anything
            self.offloaded = {n: p.detach().clone() for n, p in params.items()}
        elif not offload:
            self.offloaded = None
        for name, param in params.items():
            if not param.untyped_storage().nbytes():
                continue
            if not param.untyped_storage().resizable():  # a view or a borrowed buffer: own one first
                param.data = torch.empty_like(param)
            self.freed[name] = param.untyped_storage().nbytes()
            param.untyped_storage().resize_(0)

    async def restore(self, weights: bool, kv_cache: bool) -> None:
        """Give freed weights their memory back (offloaded ones with their bytes); the K/V
        comes back empty by itself on the next step."""
        params = self._weights()
        if weights and self.freed:
            async with self.scheduler.step_lock:
                await asyncio.to_thread(self.allocate, params)

    def allocate(self, params: dict[str, torch.Tensor] | None = None) -> None:
        """Reallocate freed weights (blocking; a load calls it before writing): the offloaded
        bytes when there are, zeros otherwise."""
        params = self._weights() if params is None else params
        kept, self.offloaded = self.offloaded, None
        with torch.no_grad():
            for name, nbytes in self.freed.items():
                params[name].untyped_storage().resize_(nbytes)
                params[name].copy_(kept[name]) if kept is not None else params[name].zero_()
        self.freed.clear()

    def hashes(self) -> dict[str, str]:
        """The runner's hashes of the served weights (blocking).  Raises ``IllegalState``
        (``weights_released``) while they are freed: freed memory is never read."""
        if self.freed:
            raise IllegalState("the weights are released: restore them first", code="weights_released")
        return self.runner.hashes()
