"""The poller: read every worker's state on an interval and hand it to the
:class:`~weightsync.router.view.FleetView`; load the journal's commits into it; keep the
router's lease on the journal alive.

:class:`Poller` holds no state of its own: :class:`~weightsync.router.service.Router` sets
the attributes declared here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any, Final

import httpx

from weightsync.core.errors import WeightSyncError
from weightsync.fleet.journal import Journal
from weightsync.router.answers import Reply
from weightsync.router.view import FleetView

__all__ = ["LEASE_S", "MAX_POLL_TIMEOUT_S", "MIN_POLL_TIMEOUT_S", "Poller", "committed_row"]

LEASE_S: Final = 30.0
"""How long the router's hold on the journal lasts unless renewed (the poller renews it)."""

MIN_POLL_TIMEOUT_S: Final = 1.0
MAX_POLL_TIMEOUT_S: Final = 5.0
"""A poll waits two poll intervals for a worker, but at least 1 s and at most 5 s: a worker
busy generating is slow to answer, not gone (a dead one refuses the connection at once)."""


class Poller:
    """Polling, the journal's commits, and the router's lease."""

    urls: list[str]
    journal: Journal
    view: FleetView
    poll_interval_s: float
    poll_timeout_s: float
    _polls: httpx.AsyncClient | None
    _admin: asyncio.Lock
    _leased_at: float

    def refresh_committed(self) -> None:
        self.view.load_journal({u: committed_row(self.journal.committed(u)) for u in self.urls})

    def _renew_lease(self, now: bool = False) -> None:
        # A transaction releases the lease when it ends: taking it again renews it too.  While
        # one runs (in its own thread) it holds and renews the lease itself.
        if self._admin.locked() and not now:
            return
        if now or time.monotonic() - self._leased_at > LEASE_S / 3:
            self.journal.acquire(LEASE_S)
            self._leased_at = time.monotonic()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            with contextlib.suppress(WeightSyncError):  # held elsewhere now: routing goes on
                self._renew_lease()
            try:
                await self.poll()
            except Exception:  # a poll must never stop polling
                await asyncio.sleep(self.poll_interval_s)

    async def _read(self, url: str) -> tuple[Reply | None, str | None]:
        assert self._polls is not None
        try:
            response = await asyncio.wait_for(
                self._polls.post(
                    f"{url}/engine/get_weight_version", content=b"{}", timeout=self.poll_timeout_s
                ),
                self.poll_timeout_s,
            )
            reply = response.json()
        except (httpx.TimeoutException, asyncio.TimeoutError):
            return None, "timeout"
        except httpx.HTTPError:
            return None, "unreachable"
        except ValueError:
            return None, "bad_reply"
        if not isinstance(reply, dict) or reply.get("status") != "ok" or response.status_code != 200:
            code = reply.get("code") if isinstance(reply, dict) else None
            return None, code if isinstance(code, str) else "bad_reply"
        return reply, None

    async def poll(self, urls: Sequence[str] | None = None) -> None:
        """Read every worker's state (bounded by the poll timeout) and apply what was seen."""
        urls = list(urls or self.urls)
        seqs = {u: self.view.workers[u].seq for u in urls}
        answers = await asyncio.gather(*(self._read(u) for u in urls))
        replies = {u: a[0] for u, a in zip(urls, answers, strict=True)}
        if self.view.baseline.source is None and len(urls) == len(self.urls):
            self.view.adopt(replies)
        for url, (reply, error) in zip(urls, answers, strict=True):
            self.view.observed(url, reply, seqs[url], error)


def committed_row(row: Any) -> dict[str, Any] | None:
    """A journal's committed row as a plain mapping (``source``, ``version``, ``epoch``, ``digest``)."""
    if row is None:
        return None
    return {k: getattr(row, k) for k in ("source", "version", "epoch", "digest")}
