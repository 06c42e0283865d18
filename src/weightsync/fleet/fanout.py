"""The coordinator's reach: one client per worker, one step sent to many workers at once
(a heartbeat names who is still owed an answer and renews the lease), and each answer
noted in the journal and turned into the decider's :class:`~._decide.Outcome`.

:class:`Fanout` holds no state of its own: :class:`~.coordinator.FleetCoordinator` sets the
attributes declared here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import httpx

from weightsync.core.errors import InvalidRequest, WeightSyncError
from weightsync.fleet._decide import Outcome, Progress
from weightsync.fleet.events import Event
from weightsync.fleet.journal import CommittedRow, Journal
from weightsync.fleet.run import Run
from weightsync.fleet.urls import worker_url
from weightsync.trainer.client import AsyncWorkerClient

__all__ = ["Fanout", "Hook", "Reply", "Source"]

Reply = dict[str, Any]
Source = str | Mapping[str, str]
Hook = Callable[[Sequence[str]], Awaitable[None]]

# Failures that say nothing about the source: a fence may leave such a worker out.
_UNREACHABLE: Final = frozenset({"unreachable", "timeout", "coordinator_error", "untrusted_epoch"})


class Fanout:
    """Clients, fan-out, heartbeats and journalled progress for the coordinator."""

    workers: list[str]
    journal: Journal
    api_key: str | None
    transport: httpx.AsyncBaseTransport | Callable[[str], httpx.AsyncBaseTransport] | None
    retries: int
    backoff_s: float
    max_backoff_s: float
    initial_source: dict[str, str] | None
    on_event: Callable[[Event], None] | None
    heartbeat_s: float
    lease_s: float
    _clients: dict[str, AsyncWorkerClient]

    def emit(
        self, phase: str, worker: str | None, what: str, detail: str = "", took: float | None = None
    ) -> None:
        if self.on_event is not None:
            self.on_event(Event(phase, worker, what, detail, duration_s=took))

    def client(self, url: str, deadline: float | None) -> AsyncWorkerClient:
        """The worker's client, bounded by ``deadline`` (a ``time.monotonic()`` value)."""
        if url not in self._clients:
            t = self.transport(url) if callable(self.transport) else self.transport
            self._clients[url] = AsyncWorkerClient(
                url, api_key=self.api_key, transport=t, retries=self.retries,
                backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s,
            )  # fmt: skip
        return self._clients[url].within(deadline)

    async def _close(self) -> None:
        clients, self._clients = self._clients, {}
        await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)

    async def _each(
        self, phase: str, urls: Sequence[str], step: Callable[[str], Awaitable[Any]], deadline: float
    ) -> tuple[dict[str, Any], dict[str, WeightSyncError]]:
        """Run ``step`` on every URL at once; a heartbeat names who is still owed an answer."""
        started = time.monotonic()
        tasks = {u: asyncio.ensure_future(step(u)) for u in urls}
        pending = set(tasks.values())
        while pending:
            _, pending = await asyncio.wait(pending, timeout=self.heartbeat_s)
            if pending:
                with contextlib.suppress(WeightSyncError):  # a long step keeps the lease alive
                    self.journal.renew(self.lease_s)
                owed = [u for u, t in tasks.items() if t in pending]
                left = max(0.0, deadline - time.monotonic())
                self.emit(phase, None, "waiting", f"{len(owed)} owed: {', '.join(owed)}; {left:.0f}s left")
        done: dict[str, Any] = {}
        failed: dict[str, WeightSyncError] = {}
        for url, task in tasks.items():
            exc = task.exception()
            if exc is None:
                done[url] = task.result()
            elif isinstance(exc, WeightSyncError):
                failed[url] = exc
            elif isinstance(exc, Exception):
                failed[url] = WeightSyncError(
                    f"{url}: the coordinator failed locally: {type(exc).__name__}: {exc}",
                    code="coordinator_error", url=url,
                )  # fmt: skip
            else:
                raise exc
        if urls:
            self.emit(phase, None, f"{len(done)}/{len(urls)} answered", took=time.monotonic() - started)
        return done, failed

    def _outcome(self, run: Run, done: Mapping[str, Any], failed: Mapping[str, WeightSyncError]) -> Outcome:
        refused: set[str] = set()
        unreachable: set[str] = set()
        for url, exc in failed.items():
            run.fail(url, exc)
            self._note(run, url, "failed", f"{exc.code}: {exc.message}")
            (unreachable if exc.code in _UNREACHABLE else refused).add(url)
        return Outcome(ok=list(done), refused=refused, unreachable=unreachable)

    def _note(self, run: Run, url: str | None, what: str, detail: str = "") -> None:
        self.journal.note(run.id, run.progress.phase, url, what, detail or None)
        self.emit(run.progress.phase, url, what, detail)

    def _advance(
        self, run: Run, progress: Progress, committed: Sequence[tuple[str, CommittedRow]] = ()
    ) -> None:
        """Journal ``progress`` (and ``committed``, in the same write) before acting on it."""
        self.journal.record(run.id, run.spec, progress, committed)
        self.journal.renew(self.lease_s)
        run.progress = progress
        self.emit(progress.phase, None, progress.trigger, ", ".join(progress.active))

    def _paths(self, source: Source) -> dict[str, str]:
        if isinstance(source, str):
            return dict.fromkeys(self.workers, source)
        paths = {worker_url(u): p for u, p in source.items()}
        if set(paths) != set(self.workers):
            raise InvalidRequest(
                "a per-worker source must name exactly the fleet's workers", code="bad_source"
            )
        return {u: paths[u] for u in self.workers}

    def _restore_source(self, url: str) -> str | None:
        row = self.journal.committed(url)
        if row is not None and row.source:
            return row.source
        return None if self.initial_source is None else self.initial_source[url]

    async def _hook(self, run: Run, hook: Hook | None, urls: Sequence[str], what: str) -> None:
        if hook is not None and urls:
            try:
                await hook(list(urls))
            except Exception as exc:  # a routing hook must not strand a transaction half-way
                self._note(run, None, f"{what} hook failed", f"{type(exc).__name__}: {exc}")
