"""The router's work, without HTTP framing: poll the workers, route completions, and run
fleet operations with the journal.

:class:`Router` owns one :class:`~weightsync.router.view.FleetView` (the decisions) and the
fleet coordinator that holds the journal (while the router runs it is the journal's one
writer), and three parts that act on them, each with its own HTTP client (polls never wait
behind completions): the poller (``poller.py``), the forwarder of completions
(``forwarding.py``) and the fleet operations (``operations.py``).  Their answers and
refusals are in ``answers.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from weightsync.core.errors import InvalidRequest, WeightSyncError
from weightsync.fleet.coordinator import FleetCoordinator
from weightsync.fleet.journal import Journal
from weightsync.fleet.urls import worker_url
from weightsync.router import logs
from weightsync.router._state import FENCED
from weightsync.router.answers import Answer, Reply
from weightsync.router.forwarding import Forwarding
from weightsync.router.metrics import RouterMetrics
from weightsync.router.operations import FleetOperations, Handoff
from weightsync.router.policy import Policy
from weightsync.router.poller import LEASE_S, Poller
from weightsync.router.streams import Upstream
from weightsync.router.view import FleetView

__all__ = ["Router"]


class Router:
    """Routes completions over ``workers`` and runs fleet operations on them.

    ``journal``: a journal file (``None``: in memory).  ``worker_api_key``: the workers'
    bearer token.  ``default_policy``: for requests that set no bounds.
    ``follow_journal``: the journal has another writer (a ``RayFleet`` driver, ``weightsync
    fleet update``): the router takes no lease, re-reads the journal's commits at every poll
    and refuses fleet updates (409 ``journal_followed``).  Raises ``InvalidRequest``
    (``journal_required``) for ``follow_journal`` without a journal file.
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
        follow_journal: bool = False,
    ) -> None:
        if follow_journal and journal is None:
            raise InvalidRequest("following a journal needs a journal file", code="journal_required")
        urls = [worker_url(u) for u in workers]
        headers = {"content-type": "application/json"}
        if worker_api_key:
            headers["authorization"] = f"Bearer {worker_api_key}"
        self.journal = Journal(journal or ":memory:")
        self.in_memory = journal is None
        self.view = FleetView(urls, on_fence=self._fenced, on_move=_moved)
        self.metrics = RouterMetrics(self.view)
        lock = asyncio.Lock()  # one fleet operation at a time
        self.poller = Poller(
            self.view,
            self.journal,
            headers=headers,
            interval_s=poll_interval_s,
            busy=lock.locked,
            follow=follow_journal,
        )
        handoff = Handoff(self.view, self.poller, self.metrics)
        self.coordinator = FleetCoordinator(
            urls,
            journal=self.journal,
            api_key=worker_api_key,
            initial_source=initial_source,
            before_pause=handoff.before_pause,
            after_commit=handoff.after_commit,
            lease_s=LEASE_S,
            on_event=logs.transaction_step,
        )
        self.urls = self.coordinator.workers
        self.operations = FleetOperations(
            self.coordinator, self.view, self.poller, self.metrics, handoff, lock, follow_journal
        )
        self.forwarder = Forwarding(
            self.view,
            self.metrics,
            headers=headers,
            timeout_s=request_timeout_s,
            poll_interval_s=poll_interval_s,
        )
        self.default_policy = default_policy or Policy()
        # The router is the journal's one writer while it runs (unless it follows another
        # writer's): another coordinator (a `weightsync fleet update` beside it) is refused
        # with journal_locked.
        self.poller.renew_lease(now=True)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the clients, read the journal, poll once (adopting a baseline), start polling."""
        if self.in_memory:
            # Epochs committed here are known to no later journal: a `weightsync fleet` command
            # on a real journal would then refuse these workers (untrusted_epoch).
            logs.emit(
                "journal_in_memory",
                logging.WARNING,
                advice="pass --journal FILE (or set $WEIGHTSYNC_FLEET_JOURNAL): commits made without "
                "one cannot be recovered, and a later journal will not trust their epochs "
                "(weightsync fleet adopt takes them over)",
            )
        # Before serving: an import running beside requests would hold the GIL under them.
        _warm_checkpoint_reader()
        self.forwarder.open()
        await self.poller.start()

    async def stop(self) -> None:
        """Stop polling, close the clients, and let the journal go (also when never started)."""
        await self.poller.stop()
        await self.forwarder.close()
        with contextlib.suppress(WeightSyncError):
            self.journal.release()
        self.journal.close()

    # ------------------------------------------------------------------ what the routes call

    async def complete(
        self, body: Reply, policy: Policy, raw: bytes | None = None, path: str = "/v1/completions"
    ) -> Answer | Upstream:
        """Route one generation request (see :meth:`Forwarding.complete`)."""
        return await self.forwarder.complete(body, policy, raw, path)

    async def models(self) -> Answer:
        """The served model list, from a routable worker."""
        return await self.forwarder.models()

    async def update(self, args: Mapping[str, Any]) -> Answer:
        """One fleet update with validated ``args`` (see :meth:`FleetOperations.update`)."""
        return await self.operations.update(args)

    async def set_version(self, version: Any) -> Answer:
        """Relabel the committed weights (see :meth:`FleetOperations.set_version`)."""
        return await self.operations.set_version(version)

    async def pause(self, mode: str, clear_cache: bool) -> Answer:
        """Pause every worker."""
        return await self.operations.pause(mode, clear_cache)

    async def resume(self) -> Answer:
        """Resume every worker, and poll them."""
        return await self.operations.resume()

    async def flush(self) -> Answer:
        """Every worker's ``flush_cache``."""
        return await self.operations.flush()

    def status(self) -> Reply:
        """``/fleet/status``: the view's status and the last update's result."""
        return {"status": "ok", **self.view.status(), "last_update": self.operations.last_update}

    def _fenced(self, url: str, why: str) -> None:
        self.metrics.fencings.labels(url, why).inc()


def _moved(url: str, before: str, after: str, why: str) -> None:
    """Log a worker's move: into fencing, back into routing (an admission), and the router's
    own moves of it (drained, updating, released, paused)."""
    if after in FENCED:
        logs.emit("fenced", worker=url, why=why, was=before)
    elif after == "routable":
        logs.emit("admitted", worker=url, was=before)
    else:
        logs.emit(
            "moved", logging.DEBUG if after == before else logging.INFO, worker=url, state=after, was=before
        )


def _warm_checkpoint_reader() -> None:
    """Load what a transaction uses to hash a checkpoint here (the trainer's checkpoint
    reader, torch under it), so the first update does not spend seconds importing it while
    the fleet waits in prepare.  Without the torch extra there is nothing to load: the
    transaction then takes the digest from the workers' dry runs."""
    with contextlib.suppress(ImportError):
        import weightsync.trainer.checkpoint  # noqa: F401
