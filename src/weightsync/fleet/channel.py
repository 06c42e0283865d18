"""How a transaction's weights reach the workers: the one seam the driver calls.

A :class:`Channel` names the dry run for one worker (validate, write nothing, say the digest
it would hold) as a :class:`~weightsync.fleet.calls.Call`, loads a batch of paused workers,
and re-pushes the weights a caller handed back for a rollback where no checkpoint is known.
Every other restore is a load of a checkpoint path (:func:`weightsync.fleet.calls.load`).
:class:`~weightsync.fleet.disk_channel.DiskChannel` loads a checkpoint path on each worker;
:class:`~weightsync.fleet.push.PushChannel` sends one packed broadcast from the trainer and
:class:`~weightsync.fleet.plan_push.PlanChannel` one sharded plan.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from weightsync.core.errors import WeightSyncError
from weightsync.fleet.calls import Call
from weightsync.fleet.urls import worker_url

__all__ = ["Channel", "Fan", "Loaded", "Reply", "by_worker"]

Reply = dict[str, Any]
Loaded = tuple[dict[str, Reply], dict[str, WeightSyncError]]
"""Replies and errors by worker URL."""
Fan = Callable[[Sequence[str], Callable[[str], Call]], Awaitable[Loaded]]
"""``fan(urls, call)``: make ``call(url)`` on each of ``urls`` at once, through the driver's
fan-out (heartbeats and all); a call that cannot be built fails that worker alone."""


@runtime_checkable
class Channel(Protocol):
    kind: str
    restores_without_source: bool
    """Whether :meth:`repush` can restore a worker no checkpoint is known for."""

    def source(self, url: str) -> str | None:
        """The path ``url`` loads (``None`` when the weights come another way)."""

    def expected_digest(self) -> str | None:
        """The digest every worker must end on, computed here (``None``: unknown)."""

    def dry_run(self, url: str) -> Call:
        """The call that validates the update on ``url``, writing nothing; its reply has
        ``digest``."""

    async def apply(self, urls: Sequence[str], fan: Fan, deadline: float) -> Loaded:
        """Load on every (paused) worker of ``urls`` by ``deadline`` (a ``time.monotonic()``
        value); replies and errors by URL."""

    async def repush(self, url: str, deadline: float) -> Reply:
        """Restore ``url`` by re-pushing the weights handed back for a rollback (only when
        :attr:`restores_without_source`); the worker's reply."""


def by_worker(
    replies: Mapping[str, Reply],
    failures: Mapping[str, WeightSyncError],
    among: Collection[str] | None = None,
) -> Loaded:
    """A push's ``replies`` and ``failures`` keyed by normalised worker URL (a pusher keys
    by the URLs it was given, the coordinator by normalised ones); only those ``among``
    when given."""
    done = {worker_url(u): r for u, r in replies.items()}
    failed = {worker_url(u): e for u, e in failures.items()}
    if among is None:
        return done, failed
    return {u: r for u, r in done.items() if u in among}, {u: e for u, e in failed.items() if u in among}
