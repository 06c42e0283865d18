"""The RL demo's fleet: worker processes, a router in front of them, and the trainer's side of
every commit.

Workers are ``weightsync serve --model-config tiny`` processes started as ``weightsync
router-demo`` starts them, labelled ``"step-0"``: the weights a fresh worker holds, which are
also the trainer's first weights.  The trainer's coordinator writes the fleet journal: it first
adopts that state (so even the first rollouts come from committed weights), then commits one
push transaction per optimizer step over a ``Broadcaster`` group.  The router runs in this
process, following that journal (``follow_journal``): it routes to a worker only on weights the
journal committed, and learns each commit at its next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Final

import httpx
import torch

from weightsync.fleet import FleetCoordinator, adopt
from weightsync.fleet.push import push_transaction
from weightsync.rl_demo.staleness import Committed, History
from weightsync.router import Router
from weightsync.router.app import create_router_app
from weightsync.router.demo import start_workers, stop_workers, wait_healthy
from weightsync.serve import ServerThread
from weightsync.trainer import Broadcaster, weights_digest

POLL_S: Final = 0.05
"""How often the router polls the workers and re-reads the journal."""


class CommitFailed(Exception):
    """A fleet transaction did not commit (or the journal does not say it did)."""


class DemoFleet:
    """The running fleet: the router's URL, the trainer's coordinator (the journal's writer)
    and group, and ``history``, every version committed so far as the journal records it."""

    def __init__(self, router_url: str, coordinator: FleetCoordinator, broadcaster: Broadcaster) -> None:
        self.router_url = router_url
        self.coordinator = coordinator
        self.broadcaster = broadcaster
        self.history = History()
        self.http = httpx.AsyncClient(base_url=router_url, timeout=30)

    def _record(self, step: int, version: Any, epoch: int | None, digest: str | None) -> Committed:
        """The commit as the journal holds it, added to :attr:`history`.  Raises
        :class:`CommitFailed` unless every worker's committed row is (version, epoch, digest)."""
        rows = self.coordinator.journal.members()
        held = {(repr(r.version), r.epoch, r.digest) for r in rows.values()}
        if (
            set(rows) != set(self.coordinator.workers)
            or held != {(repr(version), epoch, digest)}
            or epoch is None
            or digest is None
        ):
            raise CommitFailed(
                f"the journal does not hold {version!r} at epoch {epoch} on every worker: {held}"
            )
        committed = Committed(version, step, epoch, digest)
        self.history.add(committed)
        return committed

    async def adopt_initial(self, weights: Mapping[str, torch.Tensor]) -> Committed:
        """Commit what the workers hold as step 0, after checking it is ``weights`` (the
        trainer's first policy).  Raises :class:`CommitFailed` otherwise."""
        adopted = await adopt(self.coordinator)
        if not adopted.ok or adopted.digest != weights_digest(weights):
            raise CommitFailed(
                f"the workers hold {adopted.version!r} ({adopted.digest}), not the trainer's first "
                f"weights ({weights_digest(weights)}): {adopted.next_step}"
            )
        committed = self._record(0, adopted.version, adopted.epoch, adopted.digest)
        await self.routed(committed.epoch)
        return committed

    async def push(
        self, step: int, weights: Mapping[str, torch.Tensor], restore: Mapping[str, torch.Tensor]
    ) -> Committed:
        """Push ``weights`` to every worker as one fleet transaction, version ``step-<step>``
        (``restore``: what a rollback re-pushes), and wait until the router routes to them.
        Raises :class:`CommitFailed` when it does not commit."""
        result = await push_transaction(
            self.coordinator, self.broadcaster, weights, f"step-{step}", restore=restore
        )
        if not result.ok:
            raise CommitFailed(f"step-{step} did not commit ({result.phase}): {result.next_step}")
        committed = self._record(step, result.version, result.epoch, result.expected_digest)
        await self.routed(committed.epoch)
        return committed

    async def routed(self, epoch: int, timeout_s: float = 30.0) -> None:
        """Wait until the router routes to every worker at ``epoch``.  Raises
        :class:`CommitFailed` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            workers = (await self.http.get("/fleet/status")).json()["workers"]
            if all(w["routable"] and w["epoch"] == epoch for w in workers):
                return
            await asyncio.sleep(POLL_S / 2)
        raise CommitFailed(f"the router did not route epoch {epoch} within {timeout_s} s")


@contextlib.asynccontextmanager
async def demo_fleet(workers: int, root: Path) -> AsyncIterator[DemoFleet]:
    """Start ``workers`` workers and a router following a journal in ``root``, connect the
    trainer's group; stop everything on the way out."""
    procs = start_workers(workers)
    try:
        urls = [url for _, url in procs]
        await asyncio.gather(*(wait_healthy(u) for u in urls))
        journal = root / "fleet.db"
        coordinator = FleetCoordinator(urls, journal=journal)
        router = Router(urls, journal=journal, follow_journal=True, poll_interval_s=POLL_S)
        broadcaster = Broadcaster(urls, timeout_s=60)
        await broadcaster.aconnect()
        try:
            with ServerThread(create_router_app(router)) as server:
                fleet = DemoFleet(server.url, coordinator, broadcaster)
                try:
                    yield fleet
                finally:
                    await fleet.http.aclose()
        finally:
            await broadcaster.aclose()
            coordinator.journal.close()
    finally:
        stop_workers(procs)
