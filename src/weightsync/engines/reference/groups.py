"""The reference engine's weight-update groups: joining and leaving them, on the one process
or, with tensor parallelism, on every rank at once (rank ``r`` at ``rank_offset + r``, rank 0
in this process's registry; all or nothing, :meth:`~.tp_runner.TPRunner.join_update_group`).

A join runs off the event loop and is bounded by its ``timeout_s`` (the registry's
rendezvous thread); leaving a group whose join is still in progress cancels that join.
"""

from __future__ import annotations

import asyncio

from weightsync.core.requests import InitGroupRequest
from weightsync.engines.reference.runner import Runner
from weightsync.transports.distributed.worker import GroupRegistry


class ReferenceGroups:
    """The groups of one reference engine, in ``registry`` (rank 0's)."""

    def __init__(self, runner: Runner, registry: GroupRegistry) -> None:
        self.runner = runner
        self.registry = registry

    @property
    def parallel(self) -> bool:
        return len(self.runner.layout) > 1

    async def join(self, request: InitGroupRequest) -> None:
        """Join the group; with tensor parallelism every rank joins, or none does."""
        if self.parallel:
            await asyncio.to_thread(self.runner.join_update_group, self.registry, request)  # type: ignore[attr-defined]
        else:
            await asyncio.to_thread(self.registry.join, request)

    async def leave(self, group_name: str) -> None:
        """Leave the group (``NotFound`` for one never joined), or cancel its join in
        progress (whose caller gets ``join_cancelled``)."""
        if self.registry.cancel_join(group_name):
            return
        self.registry.get_any(group_name)
        if self.parallel:
            await asyncio.to_thread(self.runner.leave_update_group, self.registry, group_name)  # type: ignore[attr-defined]
        else:
            await asyncio.to_thread(self.registry.destroy, group_name)
