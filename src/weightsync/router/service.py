"""The router's work, without HTTP framing: poll the workers, route completions, and run
fleet operations with the journal.

:class:`Router` owns one :class:`~weightsync.router.view.FleetView` (the decisions), one
HTTP client per purpose (polls never wait behind completions), and the fleet coordinator
that holds the journal: while the router runs it is the journal's one writer.  Its work
lives beside it: polling in ``poller.py``, completion forwarding in ``forwarding.py``,
fleet operations in ``operations.py``, its answers and refusals in ``answers.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import httpx

from weightsync.core.errors import WeightSyncError
from weightsync.fleet.coordinator import FleetCoordinator
from weightsync.fleet.journal import Journal
from weightsync.fleet.urls import worker_url
from weightsync.router.answers import Reply
from weightsync.router.forwarding import Forwarding, completion_session
from weightsync.router.metrics import RouterMetrics
from weightsync.router.operations import FleetOperations
from weightsync.router.policy import Policy
from weightsync.router.poller import LEASE_S, MAX_POLL_TIMEOUT_S, MIN_POLL_TIMEOUT_S
from weightsync.router.view import FleetView
from weightsync.trainer.client import async_transport

__all__ = ["Router"]


class Router(Forwarding, FleetOperations):
    """Routes completions over ``workers`` and runs fleet operations on them.

    ``journal``: a journal file (``None``: in memory).  ``worker_api_key``: the workers'
    bearer token.  ``default_policy``: for requests that set no bounds.
    """

    def __init__(
        self,
        workers: Sequence[str],
        *,
        journal: str | Path | None = None,
        worker_api_key: str | None = None,
        poll_interval_s: float = 0.5,
        default_policy: Policy | None = None,
        request_timeout_s: float = 600.0,
        initial_source: str | None = None,
    ) -> None:
        urls = [worker_url(u) for u in workers]
        self.coordinator = FleetCoordinator(
            urls, journal=Journal(journal) if journal else None, api_key=worker_api_key,
            initial_source=initial_source, before_pause=self._bridge(self._before_pause),
            after_commit=self._bridge(self._after_commit), lease_s=LEASE_S,
        )  # fmt: skip
        self.journal = self.coordinator.journal
        # The router is the journal's one writer while it runs: another coordinator (a
        # `weightsync fleet update` beside it) is refused with journal_locked.
        self.journal.acquire(LEASE_S)
        self._leased_at = time.monotonic()
        self.urls = self.coordinator.workers
        self.view = FleetView(self.urls, on_fence=self._fenced)
        self.metrics = RouterMetrics(self.view)
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = min(max(2 * poll_interval_s, MIN_POLL_TIMEOUT_S), MAX_POLL_TIMEOUT_S)
        self.default_policy = default_policy or Policy()
        self.request_timeout_s = request_timeout_s
        self._headers = {"content-type": "application/json"}
        if worker_api_key:
            self._headers["authorization"] = f"Bearer {worker_api_key}"
        self._requests: aiohttp.ClientSession | None = None
        self._polls: httpx.AsyncClient | None = None
        self._poller: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admin = asyncio.Lock()
        self._batches = self._batches_done = 0
        self._drain_by = 0.0  # when a drain stops waiting for requests in flight (the update's deadline)
        self.last_update: Reply | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the clients, read the journal, poll once (adopting a baseline), start polling."""
        self._loop = asyncio.get_running_loop()
        # Before serving: an import running beside requests would hold the GIL under them.
        _warm_checkpoint_reader()
        # Idle connections are dropped before a worker's server would close them (uvicorn:
        # 5 s), so a request never races a server-side close on a reused connection.
        self._requests = completion_session(self._headers, self.request_timeout_s)
        self._polls = httpx.AsyncClient(
            headers=self._headers, transport=async_transport(), limits=httpx.Limits(keepalive_expiry=2.0)
        )
        self.refresh_committed()
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._requests is not None:
            await self._requests.close()
        if self._polls is not None:
            await self._polls.aclose()
        with contextlib.suppress(WeightSyncError):
            self.journal.release()
        self.journal.close()

    def _fenced(self, url: str, why: str) -> None:
        self.metrics.fencings.labels(url, why).inc()

    def status(self) -> Reply:
        return {"status": "ok", **self.view.status(), "last_update": self.last_update}


def _warm_checkpoint_reader() -> None:
    """Load what a transaction uses to hash a checkpoint here (the trainer's checkpoint
    reader, torch under it), so the first update does not spend seconds importing it while
    the fleet waits in prepare.  Without the torch extra there is nothing to load: the
    transaction then takes the digest from the workers' dry runs."""
    with contextlib.suppress(ImportError):
        import weightsync.trainer.checkpoint  # noqa: F401
