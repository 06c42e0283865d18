"""Fleet transactions from a trainer's push: the same commit protocol over a broadcast.

>>> with Broadcaster(urls, backend="nccl") as b:
...     result = asyncio.run(push_transaction(coordinator, b, model.state_dict(), "step-7"))

Prepare is a dry run of the stream's metadata on every worker (names, dtypes, shapes —
nothing is sent, nothing written); apply is one packed push to the group; verify compares
each worker's digest with the trainer's own digest of what it sent; commit is as for disk.
A rollback reloads each worker's last committed checkpoint from the journal (or the
coordinator's ``initial_source``), or, where none is known, re-pushes ``restore``: the
weights the caller hands back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from weightsync.core.errors import WeightSyncError
from weightsync.fleet.channels import Each, Reply
from weightsync.fleet.urls import worker_url
from weightsync.trainer import PushFailed, weights_digest
from weightsync.trainer.client import AsyncWorkerClient

if TYPE_CHECKING:
    import torch

    from weightsync.fleet.coordinator import FleetCoordinator
    from weightsync.fleet.result import TransactionResult
    from weightsync.trainer import Broadcaster


class PushChannel:
    """One connected :class:`~weightsync.trainer.Broadcaster` pushing ``tensors``."""

    kind = "push"

    def __init__(
        self,
        broadcaster: Broadcaster,
        tensors: Mapping[str, torch.Tensor],
        restore: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.broadcaster = broadcaster
        self.tensors = dict(tensors)
        self.restore = None if restore is None else dict(restore)
        self.restores_without_source = restore is not None
        self._restore_push: asyncio.Task[tuple[dict[str, Reply], dict[str, WeightSyncError]]] | None = None

    def source(self, url: str) -> str | None:
        return None

    def expected_digest(self) -> str | None:
        return weights_digest(self.tensors)

    def _metadata(self, tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
        names = list(tensors)
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
        return names, dtypes, [list(t.shape) for t in tensors.values()]

    async def dry_run(self, client: AsyncWorkerClient, url: str) -> Reply:
        names, dtypes, shapes = self._metadata(self.tensors)
        # The push is weightsync's packed stream: the dry run checks that stream (its
        # chunk plan), not a bare per-tensor one, which an inline gloo group refuses.
        reply: Reply = await client.update_weights_from_distributed(
            names,
            dtypes,
            shapes,
            self.broadcaster.group_name,
            packing={"bucket_bytes": self.broadcaster.bucket_bytes, "stream_id": "prepare"},
            dry_run=True,
        )
        return reply

    async def _push(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, Reply], dict[str, WeightSyncError]]:
        try:
            replies, failures = await self.broadcaster.apush(tensors, reset_prefix_cache=True), {}
        except PushFailed as exc:
            replies, failures = exc.replies, exc.failures
        # The broadcaster keys by the URLs it was given; the coordinator by normalised ones.
        return (
            {worker_url(u): r for u, r in replies.items()},
            {worker_url(u): e for u, e in failures.items()},
        )

    async def apply(
        self, clients: Mapping[str, AsyncWorkerClient], each: Each, deadline: float
    ) -> tuple[dict[str, Reply], dict[str, WeightSyncError]]:
        # A push reaches the whole group at once; a worker that could not pause refuses it.
        done, failed = await asyncio.wait_for(self._push(self.tensors), max(0.0, deadline - _now()))
        return {u: r for u, r in done.items() if u in clients}, {
            u: e for u, e in failed.items() if u in clients
        }

    async def reload(self, client: AsyncWorkerClient, path: str | None) -> Reply:
        if path is not None:
            reply: Reply = await client.update_weights_from_disk(path, reset_prefix_cache=True)
            return reply
        # One re-push for the whole group (a push reaches every worker of it): the first
        # worker that asks starts it, pausing the group first; the others share it.
        if self._restore_push is None:
            self._restore_push = asyncio.ensure_future(self._repush(client))
        done, failed = await self._restore_push
        if client.base_url in failed:
            raise failed[client.base_url]
        return done[client.base_url]

    async def _repush(self, asking: AsyncWorkerClient) -> tuple[dict[str, Reply], dict[str, WeightSyncError]]:
        assert self.restore is not None
        for url in self.broadcaster.urls:
            async with AsyncWorkerClient(url, api_key=self.broadcaster.api_key) as client:
                await client.within(asking.deadline).pause_generation()
        return await self._push(self.restore)


def _now() -> float:
    import time

    return time.monotonic()


async def push_transaction(
    coordinator: FleetCoordinator,
    broadcaster: Broadcaster,
    tensors: Mapping[str, torch.Tensor],
    version: Any,
    *,
    restore: Mapping[str, torch.Tensor] | None = None,
    **options: Any,
) -> TransactionResult:
    """Run one fleet transaction whose weights come from ``broadcaster`` (connected, over
    exactly the coordinator's workers).  ``options`` are :meth:`FleetCoordinator.run`'s.

    Returns the :class:`TransactionResult`; raises as :meth:`FleetCoordinator.run` does.
    """
    return await coordinator.run(PushChannel(broadcaster, tensors, restore), version, **options)
