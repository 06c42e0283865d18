"""The poller: read every worker's state on an interval and hand it to the
:class:`~weightsync.router.view.FleetView`; load the journal's commits into it; keep the
router's lease on the journal alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import httpx

from weightsync.core.errors import WeightSyncError
from weightsync.core.snapshot import json_problem
from weightsync.core.validation import strict_loads
from weightsync.fleet.journal import Journal
from weightsync.router.answers import Reply
from weightsync.router.bounded import TooLarge, read_bounded
from weightsync.router.view import FleetView
from weightsync.trainer.client import async_transport

__all__ = [
    "LEASE_S",
    "MAX_POLL_REPLY_BYTES",
    "MAX_POLL_TIMEOUT_S",
    "MIN_POLL_TIMEOUT_S",
    "Poller",
    "committed_row",
]

LEASE_S: Final = 30.0
"""How long the router's hold on the journal lasts unless renewed (the poller renews it)."""

MIN_POLL_TIMEOUT_S: Final = 1.0
MAX_POLL_TIMEOUT_S: Final = 5.0
"""A poll waits two poll intervals for a worker, but at least 1 s and at most 5 s: a worker
busy generating is slow to answer, not gone (a dead one refuses the connection at once)."""

MAX_POLL_REPLY_BYTES: Final = 256 << 10
"""The largest ``get_weight_version`` reply the poller reads (a bigger one is ``bad_reply``:
a worker's real reply is a few hundred bytes, its version label at most 64 KiB)."""


class Poller:
    """Polls the workers of ``view`` through a client of its own (fleet operations post
    through it too: short JSON calls that never wait behind completions) and holds the
    router's lease on ``journal``.

    ``headers``: sent with every call.  ``busy``: true while a fleet operation runs; its
    transaction then holds and renews the lease itself.  ``follow``: another writer keeps
    the journal: take no lease, and read its commits again before every poll.
    """

    def __init__(
        self,
        view: FleetView,
        journal: Journal,
        *,
        headers: dict[str, str],
        interval_s: float,
        busy: Callable[[], bool],
        follow: bool = False,
    ) -> None:
        self.view = view
        self.follow = follow
        self.urls = list(view.workers)
        self.journal = journal
        self.interval_s = interval_s
        self.timeout_s = min(max(2 * interval_s, MIN_POLL_TIMEOUT_S), MAX_POLL_TIMEOUT_S)
        self._headers = headers
        self._busy = busy
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._leased_at = 0.0

    @property
    def client(self) -> httpx.AsyncClient:
        """The open client (between :meth:`start` and :meth:`stop`)."""
        assert self._client is not None, "the poller is not started"
        return self._client

    async def start(self) -> None:
        """Open the client, read the journal, poll once (adopting a baseline), poll on."""
        # Idle connections are dropped before a worker's server would close them (uvicorn:
        # 5 s), so a poll never races a server-side close on a reused connection.
        self._client = httpx.AsyncClient(
            headers=self._headers, transport=async_transport(), limits=httpx.Limits(keepalive_expiry=2.0)
        )
        self.refresh_committed()
        await self.poll()
        self._task = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        """Stop polling and close the client (nothing to do when never started)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.aclose()

    def refresh_committed(self) -> None:
        """Load the journal's committed rows into the view."""
        self.view.load_journal({u: committed_row(self.journal.committed(u)) for u in self.urls})

    def renew_lease(self, now: bool = False) -> None:
        """Take the journal's lease again when a third of it has passed (``now``: at once,
        even while a fleet operation runs).  Raises ``WeightSyncError`` (``journal_locked``)
        when another writer holds it."""
        # A transaction releases the lease when it ends: taking it again renews it too.  While
        # one runs (in its own thread) it holds and renews the lease itself.
        if self.follow or (self._busy() and not now):
            return
        if now or time.monotonic() - self._leased_at > LEASE_S / 3:
            self.journal.acquire(LEASE_S)
            self._leased_at = time.monotonic()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            with contextlib.suppress(WeightSyncError):  # held elsewhere now: routing goes on
                self.renew_lease()
            try:
                await self.poll()
            except Exception:  # a poll must never stop polling
                await asyncio.sleep(self.interval_s)

    async def _read(self, url: str) -> tuple[Reply | None, str | None]:
        """One worker's ``get_weight_version`` reply, or ``None`` and why not: ``timeout``,
        ``unreachable``, ``bad_reply`` (too large, not strict JSON, too deep, not a well-formed
        reply), or the error code the worker answered with."""
        try:
            async with asyncio.timeout(self.timeout_s):
                request = self.client.build_request(
                    "POST",
                    f"{url}/engine/get_weight_version",
                    content=b"{}",
                    timeout=self.timeout_s,
                    headers={"accept-encoding": "identity"},  # the bound counts the bytes as sent
                )
                response = await self.client.send(request, stream=True)
                try:
                    raw = await read_bounded(
                        response.headers.get("content-length"), response.aiter_raw(), MAX_POLL_REPLY_BYTES
                    )
                finally:
                    await response.aclose()
            reply = strict_loads(raw.decode("utf-8"), finite=True)
        except (httpx.TimeoutException, TimeoutError):
            return None, "timeout"
        except httpx.HTTPError:
            return None, "unreachable"
        except (TooLarge, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None, "bad_reply"
        if not isinstance(reply, dict) or reply.get("status") != "ok" or response.status_code != 200:
            code = reply.get("code") if isinstance(reply, dict) else None
            return None, code if isinstance(code, str) and len(code) <= 64 else "bad_reply"
        return (reply, None) if _well_formed(reply) else (None, "bad_reply")

    async def _read_alone(self, url: str) -> tuple[Reply | None, str | None]:
        # Every worker's observation stands alone: whatever one reply raises, it is that
        # worker's bad reply, never a poll that fails for the whole fleet.
        try:
            return await self._read(url)
        except Exception:
            return None, "bad_reply"

    async def poll(self, urls: Sequence[str] | None = None) -> None:
        """Read every worker's state (bounded by the poll timeout) and apply what was seen:
        each worker's observation on its own (a bad reply fences that worker only)."""
        urls = list(urls or self.urls)
        if self.follow:  # another writer may have committed since: its rows count from now
            self.refresh_committed()
        seqs = {u: self.view.workers[u].seq for u in urls}
        answers = await asyncio.gather(*(self._read_alone(u) for u in urls))
        replies = {u: a[0] for u, a in zip(urls, answers, strict=True)}
        if self.view.baseline.source is None and len(urls) == len(self.urls):
            self.view.adopt(replies)
        for url, (reply, error) in zip(urls, answers, strict=True):
            self.view.observed(url, reply, seqs[url], error)


def _well_formed(reply: Reply) -> bool:
    """Whether a ``get_weight_version`` reply's label fields have their types (a version any
    reply can write back, an integer or null epoch, a string or null digest, boolean flags)."""
    epoch, digest = reply.get("epoch"), reply.get("digest")
    return (
        json_problem(reply.get("version")) is None
        and (epoch is None or type(epoch) is int)
        and (digest is None or (isinstance(digest, str) and len(digest) <= 256))
        and all(
            type(reply.get(k, False)) is bool
            for k in ("version_declared", "paused", "torn", "update_in_flight")
        )
    )


def committed_row(row: Any) -> dict[str, Any] | None:
    """A journal's committed row as a plain mapping (``source``, ``version``, ``epoch``, ``digest``)."""
    if row is None:
        return None
    return {k: getattr(row, k) for k in ("source", "version", "epoch", "digest")}
