"""Drive many workers at once: each call goes to every worker concurrently.

>>> fleet = Fleet(["http://w1:8000", "http://w2:8000"])
>>> fleet.pause_generation("wait")
>>> fleet.update_weights_from_disk("/ckpts/step-3", weight_version="step-3")
>>> fleet.resume_generation()

A call returns each worker's reply by URL, or raises one :class:`FleetError` that names
every worker that failed (with its error) and carries the replies of those that succeeded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from weightsync.core.errors import EngineFailure, WeightSyncError
from weightsync.trainer.client import AsyncWorkerClient
from weightsync.trainer.route_methods import RouteMethods


class FleetError(EngineFailure):
    """Some workers failed; ``failures`` maps URL to error, ``replies`` URL to reply."""

    default_code = "fleet_failed"

    def __init__(
        self, failures: dict[str, WeightSyncError], replies: dict[str, dict[str, Any]] | None = None
    ) -> None:
        lines = ", ".join(f"{url}: {exc.code} ({exc.message})" for url, exc in failures.items())
        super().__init__(f"{len(failures)} worker(s) failed: {lines}")
        self.failures = failures
        self.replies = replies or {}


async def form_group(
    mine: Awaitable[Any],
    joins: Sequence[Awaitable[Any]],
    urls: Sequence[str],
    failed: Callable[[dict[str, WeightSyncError]], BaseException],
) -> Any:
    """Form a weight-update group: the trainer's own rank 0 (``mine``, whose result has
    ``close()``) and each worker's join (``joins``, one per URL in ``urls``) at once.

    Returns the trainer's group.  Raises ``failed(failures)`` (the workers' refusals by URL)
    after closing the trainer's side when any worker refused, else the trainer's own error.
    """
    results = await asyncio.gather(mine, *joins, return_exceptions=True)
    failures = {u: r for u, r in zip(urls, results[1:], strict=True) if isinstance(r, WeightSyncError)}
    own = results[0]
    if isinstance(own, BaseException) or failures:
        if not isinstance(own, BaseException):
            own.close()
        if failures:
            raise failed(failures)
        raise own
    return own


async def gather_by_url(urls: Sequence[str], calls: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Await ``calls`` (one per URL) together; raise :class:`FleetError` if any failed."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    replies: dict[str, dict[str, Any]] = {}
    failures: dict[str, WeightSyncError] = {}
    for url, result in zip(urls, results, strict=True):
        if isinstance(result, WeightSyncError):
            failures[url] = result
        elif isinstance(result, BaseException):
            failures[url] = EngineFailure(f"{type(result).__name__}: {result}", code="unreachable")
        else:
            replies[url] = result
    if failures:
        raise FleetError(failures, replies)
    return replies


class Fleet(RouteMethods[dict[str, dict[str, Any]]]):
    """The admin routes of many workers, one method per route with the client's signature
    (each returns the replies by URL); blocking, or ``acall`` from async code."""

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.urls = list(urls)
        self.api_key = api_key
        self.timeout = timeout

    async def acall(self, route: str, body: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        clients = [AsyncWorkerClient(u, api_key=self.api_key, timeout=self.timeout) for u in self.urls]
        try:
            return await gather_by_url(self.urls, [c._call(route, dict(body or {})) for c in clients])
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    def call(self, route: str, body: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        return asyncio.run(self.acall(route, body))

    def _call(self, route: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return self.call(route, body)
