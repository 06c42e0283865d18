"""The fleet coordinator: a short driver over the pure decider (``_decide.py``).

>>> coordinator = FleetCoordinator(["http://w1:8000", "http://w2:8000"], journal="fleet.db",
...                                initial_source="/ckpts/step-0")
>>> result = await coordinator.update("/ckpts/step-3", version="step-3")
>>> result.ok, result.epoch, [w.outcome for w in result.workers]

Each turn of the loop: the decider says which phase comes next and which workers it acts
on, the journal records it, the driver sends that phase's calls to those workers
(:class:`~weightsync.trainer.client.AsyncWorkerClient`, bounded by the transaction's
deadline, connection failures retried), and collects an :class:`~._decide.Outcome`.
The commit protocol, the epochs, the lease and recovery are described in ``docs/fleet.md``.
What each phase sends lives in ``phases.py`` and ``rollback.py``, the fan-out with its
heartbeats and journalled progress in ``fanout.py``, the result assembly in ``assembly.py``.

Rolling updates: ``max_unavailable=k`` runs the workers in batches of ``k``, one
transaction.  ``before_pause(urls)`` is awaited before a batch is paused (drain it from
routing) and ``after_commit(urls)`` after it committed and resumed (return it); a rollback
calls them around the workers it takes back.  Under ``rollback`` a later batch that fails
takes the earlier batches back; under ``fence`` committed batches keep the new version.
``k`` defaults to every worker at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import httpx

from weightsync.core.errors import IllegalState, InvalidRequest, WeightSyncError
from weightsync.core.snapshot import json_problem
from weightsync.fleet import _decide
from weightsync.fleet._decide import Plan
from weightsync.fleet._values import PAUSE_MODES, POLICIES, TransactionSpec, WorkerRecord
from weightsync.fleet.assembly import assemble
from weightsync.fleet.channels import Channel, DiskChannel
from weightsync.fleet.events import Event
from weightsync.fleet.fanout import Hook, Reply, Source
from weightsync.fleet.journal import Journal
from weightsync.fleet.result import TransactionResult, WorkerStatus
from weightsync.fleet.rollback import Rollback
from weightsync.fleet.run import Run
from weightsync.fleet.urls import worker_url
from weightsync.trainer.client import AsyncWorkerClient

__all__ = ["MAX_DEADLINE_S", "FleetCoordinator", "recover"]


MAX_DEADLINE_S: Final = 86400.0
"""The longest deadline a transaction may have: a day (a longer one would act as none)."""


class FleetCoordinator(Rollback):
    """Runs fleet transactions over ``workers`` (base URLs like ``http://10.0.0.5:8000``).

    ``journal``: a :class:`Journal` or a file path (``None``: in memory, no recovery).
    ``transport``: an httpx async transport, or a function of the worker URL returning one
    (``httpx.ASGITransport`` over real worker apps runs a fleet in-process).
    ``initial_source``: where to roll back to before the journal has a committed source
    (one path, or one per worker).  ``on_event`` sees every step as it happens.
    ``live_verify``: verify by re-hashing every worker's served weights even where its load
    hashed them in the served memory and nothing wrote them since (that digest is taken by
    default: see ``docs/fleet.md``); it also catches a write made behind the control plane
    between the load and the verify, at one more pass over the weights.
    Raises ``InvalidRequest`` for a bad worker list (``bad_worker_url``, ``no_workers``,
    ``duplicate_worker`` — URLs are normalised first) or journal (``bad_journal``).
    """

    def __init__(
        self,
        workers: Sequence[str],
        *,
        journal: Journal | str | Path | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | Callable[[str], httpx.AsyncBaseTransport] | None = None,
        retries: int = 2,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        cleanup_s: float = 60.0,
        initial_source: Source | None = None,
        on_event: Callable[[Event], None] | None = None,
        before_pause: Hook | None = None,
        after_commit: Hook | None = None,
        heartbeat_s: float = 5.0,
        lease_s: float = 30.0,
        live_verify: bool = False,
    ) -> None:
        if isinstance(workers, str):
            raise InvalidRequest("workers is a list of base URLs, not one string", code="invalid_value")
        urls = [worker_url(u) for u in workers]
        if not urls:
            raise InvalidRequest("a fleet needs at least one worker", code="no_workers")
        if len(set(urls)) != len(urls):
            raise InvalidRequest("a worker URL is named twice (after normalising)", code="duplicate_worker")
        self.workers = urls
        self.journal = journal if isinstance(journal, Journal) else Journal(journal or ":memory:")
        self.api_key = api_key
        self.transport = transport
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.cleanup_s = cleanup_s
        self.initial_source = None if initial_source is None else self._paths(initial_source)
        self.on_event = on_event
        self.before_pause = before_pause
        self.after_commit = after_commit
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s
        self.live_verify = live_verify
        self._clients: dict[str, AsyncWorkerClient] = {}

    # ------------------------------------------------------------------ public API

    async def astatus(self, deadline_s: float = 10.0) -> list[WorkerStatus]:
        """Every worker's ``get_weight_version`` reply (or its error), in worker order."""
        deadline = time.monotonic() + deadline_s
        try:
            done, failed = await self._each(
                "status", self.workers, lambda u: self.client(u, deadline).get_weight_version(), deadline
            )
        finally:
            await self._close()
        return [WorkerStatus(u, done.get(u), failed.get(u)) for u in self.workers]

    def status(self, deadline_s: float = 10.0) -> list[WorkerStatus]:
        return asyncio.run(self.astatus(deadline_s))

    async def pause(self, mode: str = "keep", deadline_s: float = 60.0) -> list[WorkerStatus]:
        """Pause every worker (no transaction); each worker's state after, or its error."""
        return await self._all("pause", lambda c: c.pause_generation(mode), deadline_s)

    async def resume(self, deadline_s: float = 60.0) -> list[WorkerStatus]:
        """Resume every worker (a torn one refuses: 409 ``weights_torn``)."""
        return await self._all("resume", lambda c: c.resume_generation(), deadline_s)

    async def _all(
        self, what: str, call: Callable[[AsyncWorkerClient], Awaitable[Reply]], deadline_s: float
    ) -> list[WorkerStatus]:
        deadline = time.monotonic() + deadline_s

        async def one(url: str) -> Reply:
            client = self.client(url, deadline)
            await call(client)
            reply: Reply = await client.get_weight_version()
            return reply

        try:
            done, failed = await self._each(what, self.workers, one, deadline)
        finally:
            await self._close()
        return [WorkerStatus(u, done.get(u), failed.get(u)) for u in self.workers]

    def _check(self, policy: str, pause_mode: str, min_workers: int | None, deadline_s: float) -> int:
        if policy not in POLICIES:
            raise InvalidRequest(f"policy must be one of {POLICIES}, got {policy!r}", code="invalid_value")
        if pause_mode not in PAUSE_MODES:
            raise InvalidRequest(f"pause mode must be one of {PAUSE_MODES}", code="invalid_value")
        if not (
            isinstance(deadline_s, int | float)
            and 0 < deadline_s <= MAX_DEADLINE_S
            and math.isfinite(deadline_s)
        ):
            raise InvalidRequest(
                f"deadline_s must be a number of seconds in (0, {MAX_DEADLINE_S:g}], got {deadline_s}",
                code="invalid_value",
            )
        return len(self.workers) // 2 + 1 if min_workers is None else min_workers

    async def update(self, source: Source, version: Any, **options: Any) -> TransactionResult:
        """Run one transaction from a disk checkpoint (one path, or one per worker URL);
        ``options`` are :meth:`run`'s.

        Returns and raises as :meth:`run` does; a relative checkpoint path is an
        ``InvalidRequest`` before anything is sent.
        """
        paths = self._paths(source)
        for url, path in paths.items():
            if not Path(path).is_absolute():
                raise InvalidRequest(
                    f"checkpoint path {path!r} for {url} is relative: workers resolve paths in their own "
                    "directory, so give an absolute path",
                    code="invalid_value",
                )
        return await self.run(DiskChannel(paths), version, **options)

    def update_sync(self, source: Source, version: Any, **options: Any) -> TransactionResult:
        """:meth:`update` from blocking code."""
        return asyncio.run(self.update(source, version, **options))

    async def run(
        self,
        channel: Channel,
        version: Any,
        *,
        policy: str = "rollback",
        min_workers: int | None = None,
        max_unavailable: int | None = None,
        pause_mode: str = "keep",
        deadline_s: float = 600.0,
        expected_digest: str | None = None,
    ) -> TransactionResult:
        """Run one transaction over ``channel`` (a disk checkpoint or a trainer's push).

        Returns the :class:`TransactionResult` (``ok`` when the version committed on every
        worker, or under ``fence`` on at least ``min_workers``).  ``max_unavailable``: a
        rolling update in batches of that many workers (default: all at once).
        Raises ``InvalidRequest`` for bad arguments, ``IllegalState`` (``journal_locked``)
        when another coordinator holds the journal and ``IllegalState``
        (``unfinished_transaction``) while the journal holds one — before anything is sent.
        """
        quorum = self._check(policy, pause_mode, min_workers, deadline_s)
        problem = json_problem(version)
        if problem is not None:
            raise InvalidRequest(f"version is not a storable JSON value: {problem}", code="invalid_value")
        spec = TransactionSpec(
            version,
            tuple(WorkerRecord(u, channel.source(u)) for u in self.workers),
            policy=policy,
            min_workers=quorum,
            max_unavailable=len(self.workers) if max_unavailable is None else max_unavailable,
            pause_mode=pause_mode,
            kind=channel.kind,
            expected_digest=expected_digest,
        )
        if channel.kind in ("push", "plan") and spec.max_unavailable != len(self.workers):
            raise InvalidRequest(
                "a push reaches every worker at once: no max_unavailable", code="invalid_value"
            )
        self.journal.acquire(self.lease_s)
        try:
            unfinished = self.journal.unfinished()
            if unfinished:
                ids = ", ".join(str(t[0]) for t in unfinished)
                raise IllegalState(
                    f"the journal holds unfinished transaction(s) {ids}: run `weightsync fleet recover` "
                    "with this journal and these workers first",
                    code="unfinished_transaction",
                )
            progress = _decide.start(Plan(spec.urls, policy, quorum, spec.max_unavailable))
            run = Run(self.journal.begin(spec, progress), spec, progress)
            self.emit("preparing", None, "begin", f"txn {run.id}, version {version!r}")
            return await self._finish(run, channel, time.monotonic() + deadline_s)
        finally:
            await self._close()
            with contextlib.suppress(WeightSyncError):
                self.journal.release()

    async def recover(self, cleanup_s: float | None = None) -> list[TransactionResult]:
        """Finish or roll back every unfinished transaction in the journal, oldest first.

        Raises ``InvalidRequest`` (``workers_mismatch``) when this coordinator's workers are
        not a transaction's, ``IllegalState`` (``journal_locked``) when another coordinator
        holds the journal.
        """
        self.journal.acquire(self.lease_s)
        results = []
        try:
            for txn, spec, progress in self.journal.unfinished():
                if set(spec.urls) != set(self.workers):
                    raise InvalidRequest(
                        f"transaction {txn} ran on {sorted(spec.urls)}, not {sorted(self.workers)}",
                        code="workers_mismatch",
                    )
                run = Run(txn, spec, progress)
                self.emit(progress.phase, None, "recover", f"txn {txn}")
                self._advance(run, _decide.recover(run.plan, progress))
                channel = DiskChannel({w.url: w.source for w in spec.workers if w.source})
                results.append(
                    await self._finish(run, channel, time.monotonic() + (cleanup_s or self.cleanup_s))
                )
        finally:
            await self._close()
            with contextlib.suppress(WeightSyncError):
                self.journal.release()
        return results

    def recover_sync(self, cleanup_s: float | None = None) -> list[TransactionResult]:
        return asyncio.run(self.recover(cleanup_s))

    # ------------------------------------------------------------------ the driver

    async def _finish(self, run: Run, channel: Channel, deadline: float) -> TransactionResult:
        """decide → journal → send → collect, until the transaction is finished."""
        steps = {
            "preparing": self._prepare, "applying": self._apply, "verifying": self._verify,
            "committing": self._commit, "resuming": self._resume, "rolling_back": self._rollback,
        }  # fmt: skip
        while not run.progress.finished:
            if run.progress.phase == "rolling_back":
                deadline = max(deadline, time.monotonic() + self.cleanup_s)  # a rollback gets its own time
            outcome, committed = await steps[run.progress.phase](run, channel, deadline)
            self._advance(run, _decide.step(run.plan, run.progress, outcome), committed)
        return await self._result(run, time.monotonic() + min(self.cleanup_s, 10.0))

    async def _result(self, run: Run, deadline: float) -> TransactionResult:
        """The result, with where the fleet now is read from the workers themselves."""
        done, failed = await self._each(
            "result", self.workers, lambda u: self.client(u, deadline).get_weight_version(), deadline
        )
        return assemble(run, self.workers, done, failed)


def recover(journal: Journal | str | Path, workers: Sequence[str], **options: Any) -> list[TransactionResult]:
    """Blocking :meth:`FleetCoordinator.recover` for a journal file and its workers.

    Raises ``InvalidRequest`` (``bad_journal``) when ``journal`` is a path that is not an
    existing journal: nothing is created.
    """
    if not isinstance(journal, Journal):
        journal = Journal(journal, must_exist=True)
    return FleetCoordinator(workers, journal=journal, **options).recover_sync()
