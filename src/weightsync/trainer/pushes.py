"""What the two pushes over a weight-update group (:class:`~.broadcast.Broadcaster`,
:class:`~.sharded.ShardedPusher`) share: how a push ends — the trainer's own sending
finishes, then every worker's reply is collected, and a sending that broke leaves no worker's
request running — how the workers leave the group, and the private event loop their blocking
API runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from weightsync.core.errors import WeightSyncError
from weightsync.trainer.client import ClientPool
from weightsync.trainer.fleet import FleetError, gather_by_url


async def finish_push(
    sending: Awaitable[Any],
    posts: Sequence[asyncio.Future[Any]],
    urls: Sequence[str],
    failed: Callable[[dict[str, WeightSyncError], dict[str, dict[str, Any]]], BaseException],
) -> dict[str, dict[str, Any]]:
    """Await ``sending`` (the trainer's side of the stream), then ``posts`` (each worker's
    update request, one per URL in ``urls``).  Returns every worker's reply by URL.

    Raises what ``sending`` raised, once every post is cancelled and done (the stream broke
    on the trainer's side: no reply is worth waiting for), or ``failed(failures, replies)``
    naming each worker whose update failed."""
    try:
        await sending
    except Exception:
        for p in posts:
            p.cancel()
        await asyncio.gather(*posts, return_exceptions=True)
        raise
    try:
        return await gather_by_url(urls, posts)
    except FleetError as exc:
        raise failed(exc.failures, exc.replies) from None


async def leave_group(pool: ClientPool, group_name: str) -> None:
    """Have every worker of ``pool`` leave the group ``group_name`` (one that cannot is left
    as it is), then close the pool's clients."""
    clients = await pool.get()
    try:
        await asyncio.gather(
            *(c.destroy_weights_update_group(group_name) for c in clients), return_exceptions=True
        )
    finally:
        await pool.aclose()


class BlockingLoop:
    """The private event loop a push's blocking API (``connect``, ``push``, ``close``) runs its
    coroutines on: made at the first call, closed by :meth:`close` (a later call makes another)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` to its end on the loop; returns what it returns."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None
