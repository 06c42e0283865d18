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
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.core.errors import EngineFailure
from weightsync.fleet.calls import Call
from weightsync.fleet.channel import Fan, Loaded, Reply, by_worker
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
        self._restore_push: asyncio.Task[Loaded] | None = None

    def source(self, url: str) -> str | None:
        return None

    def expected_digest(self) -> str | None:
        return weights_digest(self.tensors)

    def _metadata(self, tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
        names = list(tensors)
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
        return names, dtypes, [list(t.shape) for t in tensors.values()]

    def dry_run(self, url: str) -> Call:
        names, dtypes, shapes = self._metadata(self.tensors)
        # The push is weightsync's packed stream: the dry run checks that stream (its
        # chunk plan), not a bare per-tensor one, which an inline gloo group refuses.
        packing = {"bucket_bytes": self.broadcaster.bucket_bytes, "stream_id": "prepare"}
        return Call(
            url,
            "update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": self.broadcaster.group_name,
                "packing": packing,
                "dry_run": True,
            },
        )

    async def _push(self, tensors: Mapping[str, torch.Tensor]) -> Loaded:
        try:
            replies, failures = await self.broadcaster.apush(tensors, reset_prefix_cache=True), {}
        except PushFailed as exc:
            replies, failures = exc.replies, exc.failures
        except Exception as exc:  # a bare collective error: every worker's outcome, never an escape
            replies = {}
            failures = {
                u: EngineFailure(
                    f"the push failed on the trainer's side ({type(exc).__name__}: {str(exc)[:300]}); "
                    "whether it wrote to this worker is for verify to tell",
                    code="push_failed",
                )
                for u in self.broadcaster.urls
            }
        return by_worker(replies, failures)

    async def apply(self, urls: Sequence[str], fan: Fan, deadline: float) -> Loaded:
        # A push reaches the whole group at once; a worker that could not pause refuses it.
        done, failed = await asyncio.wait_for(self._push(self.tensors), max(0.0, deadline - time.monotonic()))
        return by_worker(done, failed, urls)

    async def repush(self, url: str, deadline: float) -> Reply:
        # One re-push for the whole group (a push reaches every worker of it): the first
        # worker that asks starts it, pausing the group first; the others share it.
        if self._restore_push is None:
            self._restore_push = asyncio.ensure_future(self._repush(deadline))
        done, failed = await self._restore_push
        if url in failed:
            raise failed[url]
        return done[url]

    async def _repush(self, deadline: float) -> Loaded:
        assert self.restore is not None
        for url in self.broadcaster.urls:
            client = AsyncWorkerClient(
                url, api_key=self.broadcaster.api_key, transport=self.broadcaster.transport
            )
            async with client:
                await client.within(deadline).pause_generation()
        return await self._push(self.restore)


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
