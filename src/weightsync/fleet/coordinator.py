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
What each phase sends is built as data in ``calls.py`` and its replies are read in
``outcomes.py``; ``phases.py`` runs one phase, ``fanout.py`` plays one call sequence per
worker on every worker at once, with heartbeats.

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from weightsync.core.errors import IllegalState, InvalidRequest, WeightSyncError
from weightsync.core.requests import MAX_TIMEOUT_S
from weightsync.core.snapshot import json_problem
from weightsync.fleet import _decide, calls
from weightsync.fleet._decide import Frame
from weightsync.fleet.calls import Call
from weightsync.fleet.channel import Channel
from weightsync.fleet.clocks import CLOCK_SKEW_S
from weightsync.fleet.context import Context, Hook
from weightsync.fleet.delta_channel import DeltaChannel
from weightsync.fleet.disk_channel import DiskChannel
from weightsync.fleet.doubts import Doubts
from weightsync.fleet.events import Event
from weightsync.fleet.fanout import Fanout, Transport
from weightsync.fleet.journal import Journal
from weightsync.fleet.outcomes import assemble
from weightsync.fleet.phases import PHASES
from weightsync.fleet.records import PAUSE_MODES, POLICIES, TransactionSpec, WorkerRecord
from weightsync.fleet.result import TransactionResult, WorkerStatus
from weightsync.fleet.transaction import Transaction
from weightsync.fleet.urls import check_absolute, worker_url

__all__ = ["MAX_DEADLINE_S", "RESULT_S", "FleetCoordinator", "Source", "recover"]

Source = str | Mapping[str, str]

MAX_DEADLINE_S: Final = MAX_TIMEOUT_S
"""The longest deadline a transaction may have: a day (a longer one would act as none)."""

RESULT_S: Final = 10.0
"""The most a transaction's last step, reading where every worker ended, may take."""


class FleetCoordinator:
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
        transport: Transport = None,
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
        self.cleanup_s = cleanup_s
        self.lease_s = lease_s
        self.on_event = on_event
        self.fanout = Fanout(
            api_key=api_key,
            transport=transport,
            retries=retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            heartbeat_s=heartbeat_s,
            emit=self.emit,
            beat=self._renew,
        )
        self.context = Context(
            self.fanout,
            self.journal,
            self.emit,
            lease_s,
            before_pause,
            after_commit,
            live_verify,
            None if initial_source is None else _paths(urls, initial_source),
        )

    def emit(
        self, phase: str, worker: str | None, what: str, detail: str = "", took: float | None = None
    ) -> None:
        if self.on_event is not None:
            self.on_event(Event(phase, worker, what, detail, duration_s=took))

    def _renew(self) -> None:
        with contextlib.suppress(WeightSyncError):  # a long step keeps the lease alive
            self.journal.renew(self.lease_s)

    # ------------------------------------------------------------------ public API

    async def astatus(self, deadline_s: float = 10.0) -> list[WorkerStatus]:
        """Every worker's ``get_weight_version`` reply (or its error), in worker order."""
        return await self._all("status", None, deadline_s)

    def status(self, deadline_s: float = 10.0) -> list[WorkerStatus]:
        return asyncio.run(self.astatus(deadline_s))

    async def pause(self, mode: str = "keep", deadline_s: float = 60.0) -> list[WorkerStatus]:
        """Pause every worker (no transaction); each worker's state after, or its error."""
        return await self._all("pause", lambda u: calls.pause(u, mode), deadline_s)

    async def resume(self, deadline_s: float = 60.0, allow_mislabelled: bool = False) -> list[WorkerStatus]:
        """Resume every worker whose label describes its weights; one whose label does not
        (``version_current`` false) stays paused with ``version_not_current`` unless
        ``allow_mislabelled``, and a torn one refuses (409 ``weights_torn``)."""
        scripts = {u: calls.resume_labelled(u, allow_mislabelled) for u in self.workers}
        return await self._all("resume", None, deadline_s, scripts)

    async def _all(
        self,
        what: str,
        first: Callable[[str], Call] | None,
        deadline_s: float,
        scripts: Mapping[str, calls.Script[Any]] | None = None,
    ) -> list[WorkerStatus]:
        """``first`` (if any) on every worker, then its state read back (or ``scripts``,
        whose value is the state)."""
        deadline = time.monotonic() + deadline_s
        if scripts is None:
            scripts = {u: calls.read_after(u, None if first is None else first(u)) for u in self.workers}
        try:
            done, failed = await self.fanout.play(what, scripts, deadline)
        finally:
            await self.fanout.close()
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

    async def update(
        self, source: Source, version: Any, *, relabel: bool = False, **options: Any
    ) -> TransactionResult:
        """Run one transaction from a disk checkpoint (one path, or one per worker URL);
        ``options`` are :meth:`run`'s.  A checkpoint whose manifest names another version than
        ``version`` is refused at prepare (``version_mismatch``) unless ``relabel``.

        Returns and raises as :meth:`run` does; a relative checkpoint path is an
        ``InvalidRequest`` before anything is sent.
        """
        paths = _paths(self.workers, source)
        check_absolute(paths, "checkpoint")
        return await self.run(DiskChannel(paths, [version], relabel), version, **options)

    def update_sync(self, source: Source, version: Any, **options: Any) -> TransactionResult:
        """:meth:`update` from blocking code."""
        return asyncio.run(self.update(source, version, **options))

    def update_from_delta_sync(
        self, source: Source, version: Any = None, **options: Any
    ) -> TransactionResult:
        """:func:`~weightsync.fleet.delta_channel.delta_transaction` from blocking code: one
        transaction from the delta checkpoint at ``source`` (one path, or one per worker)."""
        from weightsync.fleet.delta_channel import delta_transaction

        return asyncio.run(delta_transaction(self, source, version, **options))

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
        Raises ``InvalidRequest`` for bad arguments (a ``channel`` without every member of
        :class:`~weightsync.fleet.channel.Channel` among them), ``IllegalState`` (``journal_locked``)
        when another coordinator holds the journal and ``IllegalState``
        (``unfinished_transaction``) while the journal holds one — before anything is sent.
        """
        quorum = self._check(policy, pause_mode, min_workers, deadline_s)
        if not isinstance(channel, Channel):  # every member is checked here, before anything is sent
            raise InvalidRequest(
                f"{type(channel).__name__} is not a weightsync.fleet.Channel", code="invalid_value"
            )
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
            delta=channel.record if isinstance(channel, DeltaChannel) else None,
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
            progress = _decide.start(Frame.of(spec))
            tx = Transaction(self.journal.begin(spec, progress), spec, progress)
            self.emit("preparing", None, "begin", f"txn {tx.id}, version {version!r}")
            return await self._finish(tx, channel, time.monotonic() + deadline_s)
        finally:
            await self.fanout.close()
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
                tx = Transaction(txn, spec, progress, recovered_from=progress.phase)
                if (
                    spec.not_after is not None
                ):  # a commit it sent may be in flight (its clock readings died with it)
                    tx.doubts = Doubts.all_until(spec.urls, spec.not_after + CLOCK_SKEW_S)
                self.emit(progress.phase, None, "recover", f"txn {txn}")
                self.context.advance(tx, _decide.recover(tx.frame, progress))
                channel = _recovered(spec)
                results.append(
                    await self._finish(tx, channel, time.monotonic() + (cleanup_s or self.cleanup_s))
                )
        finally:
            await self.fanout.close()
            with contextlib.suppress(WeightSyncError):
                self.journal.release()
        return results

    def recover_sync(self, cleanup_s: float | None = None) -> list[TransactionResult]:
        return asyncio.run(self.recover(cleanup_s))

    # ------------------------------------------------------------------ the driver

    async def _finish(self, tx: Transaction, channel: Channel, deadline: float) -> TransactionResult:
        """journal → send → collect, until the transaction is finished: the phase the journal
        holds sends its calls and collects their outcome, the decider steps, and the step is
        journalled before the next turn acts on it.

        Every phase ends by ``deadline``; a rollback has ``cleanup_s`` of its own, counted
        from when the commits it undoes can no longer land; the end is journalled only once
        no commit in doubt can land; reading the result takes :data:`RESULT_S` at most.
        """
        ctx = self.context
        while not tx.progress.finished:
            if tx.progress.phase == "rolling_back":  # its own time, once no late commit can undo it
                deadline = max(deadline, time.monotonic() + tx.doubts.unsettled() + self.cleanup_s)
            try:
                outcome, committed = await PHASES[tx.progress.phase](ctx, tx, channel, deadline)
            except Exception as exc:  # a channel's failure is every active worker's outcome
                if isinstance(exc, WeightSyncError) and exc.code in ("bad_journal", "journal_locked"):
                    raise  # the journal cannot record what happens next
                outcome, committed = ctx.crashed(tx, exc), []
            progress = _decide.step(tx.frame, tx.progress, outcome)
            if progress.finished:
                await ctx.settle(tx)  # reported only once no commit it sent can land
            ctx.advance(tx, progress, committed)
        return await self._result(tx, time.monotonic() + min(self.cleanup_s, RESULT_S))

    async def _result(self, tx: Transaction, deadline: float) -> TransactionResult:
        """The result, with where the fleet now is read from the workers themselves."""
        scripts = {u: calls.read_after(u) for u in self.workers}
        done, failed = await self.fanout.play("result", scripts, deadline)
        return assemble(tx, self.workers, done, failed)


def _paths(workers: Sequence[str], source: Source) -> dict[str, str]:
    """One checkpoint path per worker, in worker order, from one path or one per worker.

    Raises ``InvalidRequest`` (``bad_source``) unless a mapping names exactly ``workers``.
    """
    if isinstance(source, str):
        return dict.fromkeys(workers, source)
    paths = {worker_url(u): p for u, p in source.items()}
    if set(paths) != set(workers):
        raise InvalidRequest("a per-worker source must name exactly the fleet's workers", code="bad_source")
    return {u: paths[u] for u in workers}


def _recovered(spec: TransactionSpec) -> Channel:
    """The channel an unfinished transaction ran on, rebuilt from its spec (a push's weights
    are gone: its rollback reloads checkpoints only)."""
    if spec.delta is not None:
        return DeltaChannel(spec.delta)
    return DiskChannel({w.url: w.source for w in spec.workers if w.source})


def recover(journal: Journal | str | Path, workers: Sequence[str], **options: Any) -> list[TransactionResult]:
    """Blocking :meth:`FleetCoordinator.recover` for a journal file and its workers.

    Raises ``InvalidRequest`` (``bad_journal``) when ``journal`` is a path that is not an
    existing journal: nothing is created.
    """
    if not isinstance(journal, Journal):
        journal = Journal(journal, must_exist=True)
    return FleetCoordinator(workers, journal=journal, **options).recover_sync()
