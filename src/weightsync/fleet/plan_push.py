"""Fleet transactions from a sharded push: the commit protocol over a transfer plan.

>>> with ShardedPusher(0, layout, workers=urls, master_port=port) as p:   # on trainer rank 0
...     result = asyncio.run(plan_transaction(coordinator, p, my_shards, "step-7",
...                                           expected_digest=digest_of_the_full_weights))

Prepare is a dry run of each worker's part of the plan (checked against what the worker
serves, every rank of it: nothing sent, nothing written); apply is one push of the plan
(:meth:`ShardedPusher.push`: every trainer rank sends what it holds, every worker rank
receives and verifies only what it serves); verify compares each worker's digest with
``expected_digest``; commit is as for disk.

``expected_digest`` is the digest of the full weights the plan delivers
(:func:`weightsync.trainer.weights_digest` of the full state dict, or of the checkpoint it
was saved as): trainer rank 0 holds only its shards, so it cannot compute it alone.

A rollback reloads each worker's last committed checkpoint from the journal (or the
coordinator's ``initial_source``).  A plan is not re-pushed to undo one: its other trainer
ranks are not in step with the coordinator.  They call :meth:`ShardedPusher.push` once per
transaction, as always; when a transaction ends before its apply (a refusal in prepare),
rank 0 tells them so (:meth:`ShardedPusher.skip`) and their push returns without sending.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.core.errors import NotSupported, WeightSyncError
from weightsync.fleet.calls import Call
from weightsync.fleet.channel import Fan, Loaded, Reply, by_worker
from weightsync.fleet.urls import worker_url
from weightsync.trainer.sharded import ShardedPushFailed

if TYPE_CHECKING:
    import torch

    from weightsync.fleet.coordinator import FleetCoordinator
    from weightsync.fleet.result import TransactionResult
    from weightsync.trainer.sharded import ShardedPusher


class PlanChannel:
    """One connected :class:`~weightsync.trainer.sharded.ShardedPusher` (trainer rank 0)
    pushing ``held``, this rank's shards."""

    kind = "plan"
    restores_without_source = False

    def __init__(self, pusher: ShardedPusher, held: Mapping[str, torch.Tensor], expected_digest: str) -> None:
        self.pusher = pusher
        self.held = dict(held)
        self._expected = expected_digest
        self.applied = False
        self._index = {worker_url(u): i for i, u in enumerate(pusher.urls)}

    def source(self, url: str) -> str | None:
        return None

    def expected_digest(self) -> str | None:
        return self._expected

    def dry_run(self, url: str) -> Call:
        part = self.pusher.plan.part(self._index[worker_url(url)])
        return Call(
            url,
            "update_weights_from_plan",
            {
                "group_name": self.pusher.group_name,
                "stream_id": f"dry-run-{uuid.uuid4().hex}",
                "plan": part.to_wire(),
                "dry_run": True,
            },
        )

    async def apply(self, urls: Sequence[str], fan: Fan, deadline: float) -> Loaded:
        # One push reaches every worker of the plan at once; the trainer's other ranks are in it.
        self.applied = True
        try:
            replies = await asyncio.wait_for(
                asyncio.to_thread(self.pusher.push, self.held, reset_prefix_cache=True),
                max(0.0, deadline - time.monotonic()),
            )
            failures: dict[str, WeightSyncError] = {}
        except ShardedPushFailed as exc:
            replies, failures = exc.replies, exc.failures
        return by_worker(replies, failures, urls)

    async def repush(self, url: str, deadline: float) -> Reply:
        raise NotSupported(
            "a plan cannot be re-pushed to roll back (the trainer's other ranks are not in step): "
            "give the coordinator an initial_source or commit checkpoints first",
            code="not_supported",
        )


async def plan_transaction(
    coordinator: FleetCoordinator,
    pusher: ShardedPusher,
    held: Mapping[str, torch.Tensor],
    version: Any,
    *,
    expected_digest: str,
    **options: Any,
) -> TransactionResult:
    """Run one fleet transaction whose weights come from ``pusher``'s plan (trainer rank 0,
    connected, over exactly the coordinator's workers); ``held`` is this rank's shards,
    ``expected_digest`` the digest of the full weights (see the module docstring).
    ``options`` are :meth:`FleetCoordinator.run`'s.

    Returns the :class:`TransactionResult`; raises as :meth:`FleetCoordinator.run` does."""
    channel = PlanChannel(pusher, held, expected_digest)
    try:
        return await coordinator.run(channel, version, **options)
    finally:
        if not channel.applied:  # the other trainer ranks wait in their push: release them
            await asyncio.to_thread(pusher.skip)
