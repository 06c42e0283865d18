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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import httpx

from weightsync.core.errors import EngineUnavailable, IllegalState, InvalidRequest, WeightSyncError
from weightsync.core.values import json_problem
from weightsync.trainer.client import AsyncWorkerClient

from . import _decide
from ._decide import Outcome, Plan, Progress
from ._values import PAUSE_MODES, POLICIES, Held, TransactionSpec, WorkerRecord
from .channels import Channel, DiskChannel, checkpoint_digest
from .journal import ADOPT_LIMIT, CommittedRow, Journal
from .result import TransactionResult, WorkerOutcome, WorkerStatus
from .urls import worker_url

__all__ = ["MAX_DEADLINE_S", "Event", "FleetCoordinator", "checkpoint_digest", "recover", "worker_url"]

Reply = dict[str, Any]
Source = str | Mapping[str, str]
Hook = Callable[[Sequence[str]], Awaitable[None]]

MAX_DEADLINE_S: Final = 86400.0
"""The longest deadline a transaction may have: a day (a longer one would act as none)."""

# Failures that say nothing about the source: a fence may leave such a worker out.
_UNREACHABLE: Final = frozenset({"unreachable", "timeout", "coordinator_error", "untrusted_epoch"})


@attrs.frozen
class Event:
    """One step as it happens: a phase change (``worker`` is None), a worker's step, or a
    heartbeat (``what == "waiting"``, ``detail`` naming the workers still owed an answer)."""

    phase: str
    worker: str | None
    what: str
    detail: str = ""
    at: float = attrs.field(factory=time.time)
    duration_s: float | None = None

    def line(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.at)) + f".{int(self.at % 1 * 1000):03d}"
        took = f" in {self.duration_s:.2f}s" if self.duration_s is not None else ""
        who = self.worker or "fleet"
        return f"{stamp} [{self.phase}] {who}: {self.what}{took}" + (
            f" ({self.detail})" if self.detail else ""
        )


@attrs.define
class _Run:
    """One transaction while it runs (its durable part is ``spec`` and ``progress``)."""

    id: int
    spec: TransactionSpec
    progress: Progress
    errors: dict[str, list[WeightSyncError]] = attrs.field(factory=dict)
    resume_failed: set[str] = attrs.field(factory=set)
    rolled: set[str] = attrs.field(factory=set)

    @property
    def plan(self) -> Plan:
        s = self.spec
        return Plan(s.urls, s.policy, s.min_workers, s.max_unavailable)

    def fail(self, url: str, exc: WeightSyncError) -> None:
        self.errors.setdefault(url, []).append(exc)


class FleetCoordinator:
    """Runs fleet transactions over ``workers`` (base URLs like ``http://10.0.0.5:8000``).

    ``journal``: a :class:`Journal` or a file path (``None``: in memory, no recovery).
    ``transport``: an httpx async transport, or a function of the worker URL returning one
    (``httpx.ASGITransport`` over real worker apps runs a fleet in-process).
    ``initial_source``: where to roll back to before the journal has a committed source
    (one path, or one per worker).  ``on_event`` sees every step as it happens.
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
        self._clients: dict[str, AsyncWorkerClient] = {}

    # ------------------------------------------------------------------ plumbing

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

    def _outcome(self, run: _Run, done: Mapping[str, Any], failed: Mapping[str, WeightSyncError]) -> Outcome:
        refused: set[str] = set()
        unreachable: set[str] = set()
        for url, exc in failed.items():
            run.fail(url, exc)
            self._note(run, url, "failed", f"{exc.code}: {exc.message}")
            (unreachable if exc.code in _UNREACHABLE else refused).add(url)
        return Outcome(ok=list(done), refused=refused, unreachable=unreachable)

    def _note(self, run: _Run, url: str | None, what: str, detail: str = "") -> None:
        self.journal.note(run.id, run.progress.phase, url, what, detail or None)
        self.emit(run.progress.phase, url, what, detail)

    def _advance(
        self, run: _Run, progress: Progress, committed: Sequence[tuple[str, CommittedRow]] = ()
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

    async def update(
        self,
        source: Source,
        version: Any,
        *,
        policy: str = "rollback",
        min_workers: int | None = None,
        max_unavailable: int | None = None,
        pause_mode: str = "keep",
        deadline_s: float = 600.0,
        expected_digest: str | None = None,
    ) -> TransactionResult:
        """Run one transaction from a disk checkpoint (one path, or one per worker URL).

        Returns the :class:`TransactionResult` (``ok`` when the version committed on every
        worker, or under ``fence`` on at least ``min_workers``).  ``max_unavailable``: a
        rolling update in batches of that many workers (default: all at once).
        Raises ``InvalidRequest`` for bad arguments, ``IllegalState`` (``journal_locked``)
        when another coordinator holds the journal and ``IllegalState``
        (``unfinished_transaction``) while the journal holds one — before anything is sent.
        """
        paths = self._paths(source)
        for url, path in paths.items():
            if not Path(path).is_absolute():
                raise InvalidRequest(
                    f"checkpoint path {path!r} for {url} is relative: workers resolve paths in their own "
                    "directory, so give an absolute path",
                    code="invalid_value",
                )
        return await self.run(DiskChannel(paths), version, policy=policy, min_workers=min_workers,
                              max_unavailable=max_unavailable, pause_mode=pause_mode,
                              deadline_s=deadline_s, expected_digest=expected_digest)  # fmt: skip

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
        """Run one transaction over ``channel`` (a disk checkpoint or a trainer's push)."""
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
        if channel.kind == "push" and spec.max_unavailable != len(self.workers):
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
            run = _Run(self.journal.begin(spec, progress), spec, progress)
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
                run = _Run(txn, spec, progress)
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

    async def _finish(self, run: _Run, channel: Channel, deadline: float) -> TransactionResult:
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

    async def _prepare(self, run: _Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        spec = run.spec

        async def one(url: str) -> tuple[Reply, Reply]:
            client = self.client(url, deadline)
            before = await client.get_weight_version()
            dry = await channel.dry_run(client, url)
            self._note(run, url, "dry run ok", f"digest {_short(dry.get('digest'))}")
            return before, dry

        done, failed = await self._each("preparing", run.progress.active, one, deadline)
        # The fleet epoch comes from the journal.  A fresh journal takes over a running
        # fleet at its highest (plausible) epoch; after that a worker's higher epoch is a
        # claim the journal never made: reported, and the worker is left out.
        issued = self.journal.issued_epoch()
        epochs = {u: b.get("epoch") for u, (b, _) in done.items() if isinstance(b.get("epoch"), int)}
        floor = issued if issued else max([e for e in epochs.values() if e < ADOPT_LIMIT], default=0)
        for url, epoch in epochs.items():
            if epoch > floor:
                done.pop(url)
                failed[url] = EngineUnavailable(
                    f"{url} reports epoch {epoch}, which this journal never issued (it issued up to "
                    f"{floor}): restart the worker, or use the journal that committed it",
                    code="untrusted_epoch", url=url,
                )  # fmt: skip
        expected = spec.expected_digest or channel.expected_digest()
        for url, (_, dry) in list(done.items()):
            digest = dry.get("digest")
            if expected is None and digest is not None:
                expected = digest
            elif digest is not None and digest != expected:
                done.pop(url)
                failed[url] = IllegalState(
                    f"{url}: the dry run would hold digest {digest}, expected {expected}",
                    code="digest_mismatch", url=url,
                )  # fmt: skip
        outcome = self._outcome(run, done, failed)
        for url, (before, _) in done.items():
            held = Held.from_status(before, self._restore_source(url))
            run.spec = run.spec.with_worker(attrs.evolve(run.spec.worker(url), previous=held))
        if not outcome.refused and (not outcome.unreachable or spec.policy == "fence"):
            run.spec = attrs.evolve(run.spec, expected_digest=expected, epoch=self.journal.issue_epoch(floor))
        return outcome, []

    async def _hook(self, run: _Run, hook: Hook | None, urls: Sequence[str], what: str) -> None:
        if hook is not None and urls:
            try:
                await hook(list(urls))
            except Exception as exc:  # a routing hook must not strand a transaction half-way
                self._note(run, None, f"{what} hook failed", f"{type(exc).__name__}: {exc}")

    async def _apply(self, run: _Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        active = run.progress.active
        await self._hook(run, self.before_pause, active, "before_pause")

        async def pause(url: str) -> None:
            await self.client(url, deadline).pause_generation(run.spec.pause_mode)
            self._note(run, url, "paused", run.spec.pause_mode)

        paused, failed = await self._each("applying", active, pause, deadline)
        loaded, more = await channel.apply(
            {u: self.client(u, deadline) for u in paused}, self._each, deadline
        )
        for url, reply in loaded.items():
            self._note(run, url, "loaded", f"digest {_short(reply.get('digest'))}")
        return self._outcome(run, loaded, {**failed, **more}), []

    async def _attest(self, url: str, deadline: float, expected: str | None) -> Reply:
        """The worker's digest, recomputed from what it serves where it can.

        Raises ``IllegalState`` (``digest_mismatch``) when it is not ``expected`` or the
        recomputed digest differs from the recorded one (changed outside the control plane).
        """
        client = self.client(url, deadline)
        reply: Reply
        try:
            reply = await client.verify_weights()
        except WeightSyncError as exc:
            if exc.code not in ("unknown_route", "not_found", "not_supported"):
                raise
            reply = await client.get_weight_version()
        else:
            if reply.get("match") is not True:
                raise IllegalState(
                    f"{url}: serves digest {reply.get('digest')}, but recorded {reply.get('recorded_digest')}: "
                    "the weights were changed outside the control plane",
                    code="digest_mismatch", url=url,
                )  # fmt: skip
        if expected is None or reply.get("digest") != expected:
            raise IllegalState(
                f"{url}: holds digest {reply.get('digest')}, expected {expected}",
                code="digest_mismatch",
                url=url,
            )
        return reply

    async def _verify(self, run: _Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        expected = run.spec.expected_digest
        done, failed = await self._each(
            "verifying", run.progress.active, lambda u: self._attest(u, deadline, expected), deadline
        )
        for url in done:
            self._note(run, url, "verified", f"digest {_short(expected)}")
        return self._outcome(run, done, failed), []

    async def _declare(
        self, url: str, deadline: float, version: Any, epoch: int | None, digest: str | None
    ) -> Reply:
        """Declare ``version`` at ``epoch`` guarded by ``digest``, then read it back.

        Raises ``IllegalState`` (``commit_not_read_back``) when the worker's state afterwards
        is not exactly that (a 200 is a claim; the read-back is the evidence)."""
        client = self.client(url, deadline)
        options: dict[str, Any] = {} if epoch is None else {"epoch": epoch}
        if digest is not None:
            options["expected_digest"] = digest
        await client.set_weight_version(version, **options)
        back: Reply = await client.get_weight_version()
        want = {"version": version, "version_declared": True, "epoch": epoch, "digest": digest, "torn": False}
        got = {k: back.get(k) for k in want}
        if digest is None:
            got["digest"] = None
        if got != want:
            raise IllegalState(
                f"{url}: after the declaration it reports {got}, not {want}",
                code="commit_not_read_back",
                url=url,
            )
        return back

    async def _commit(self, run: _Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        s = run.spec
        done, failed = await self._each(
            "committing", run.progress.active,
            lambda u: self._declare(u, deadline, s.version, s.epoch, s.expected_digest), deadline,
        )  # fmt: skip
        outcome = self._outcome(run, done, failed)
        committed = []
        if not outcome.failed or s.policy == "fence":
            assert s.epoch is not None
            for url in done:
                self._note(run, url, "declared", f"epoch {s.epoch}")
                committed.append(
                    (url, CommittedRow(s.worker(url).source, s.version, s.epoch, s.expected_digest))
                )
        return outcome, committed

    async def _resume(self, run: _Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        """Resume the committed batch; a worker that does not hold the commit (it restarted)
        is first brought onto it.  One that cannot be stays paused and is reported."""
        s = run.spec

        async def one(url: str) -> None:
            client = self.client(url, deadline)
            now = await client.get_weight_version()
            if (now.get("version"), now.get("epoch"), now.get("digest"), now.get("torn")) != (
                s.version, s.epoch, s.expected_digest, False,
            ):  # fmt: skip
                self._note(run, url, "does not hold the commit", "bringing it onto it")
                await client.pause_generation(s.pause_mode)
                source = s.worker(url).source
                if source is None:
                    raise IllegalState(f"{url}: no source to load the commit from", code="no_restore_source")
                await channel.reload(client, source)
                await self._declare(url, deadline, s.version, s.epoch, s.expected_digest)
            await client.resume_generation()
            self._note(run, url, "serving", f"version {s.version!r}, epoch {s.epoch}")

        active = run.progress.active
        done, failed = await self._each("resuming", active, one, deadline)
        for url, exc in failed.items():
            run.fail(url, exc)
            run.resume_failed.add(url)
            self._note(run, url, "not resumed", f"{exc.code}: {exc.message}")
        await self._hook(run, self.after_commit, [u for u in active if u in done], "after_commit")
        return Outcome(ok=active), []

    async def _rollback(self, run: _Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        """Pause, restore the last committed weights, re-declare the old version under a new
        epoch, read it back, resume what was running.  Epochs only go up."""
        s = run.spec
        if s.rollback_epoch is None:
            run.spec = s = attrs.evolve(s, rollback_epoch=self.journal.issue_epoch(s.epoch or 0))
            self.journal.record(run.id, s, run.progress)
        active = run.progress.active
        serving = [u for u in active if u in run.progress.committed]
        await self._hook(run, self.before_pause, serving, "before_pause")

        async def one(url: str) -> CommittedRow | None:
            client = self.client(url, deadline)
            prev = s.worker(url).previous
            if prev is None:
                return None
            await client.pause_generation(s.pause_mode)
            now = await client.get_weight_version()
            changed = now.get("torn") is True or now.get("digest") != prev.digest or prev.digest is None
            # A re-push reaches the whole group: every worker waits for it, none resumes early.
            changed |= prev.source is None and getattr(channel, "restores_without_source", False)
            if changed:
                if prev.source is None and not getattr(channel, "restores_without_source", False):
                    raise IllegalState(
                        f"{url}: holds digest {_short(now.get('digest'))} and no committed source is known "
                        "to restore: it stays paused; run `weightsync fleet update` with a checkpoint, "
                        "or pass --initial-source next time",
                        code="no_rollback_source", url=url,
                    )  # fmt: skip
                reply = await channel.reload(client, prev.source)
                if prev.digest is not None and reply.get("digest") != prev.digest:
                    raise IllegalState(
                        f"{url}: restored digest {reply.get('digest')}, expected {prev.digest}: it stays paused",
                        code="digest_mismatch", url=url,
                    )  # fmt: skip
                run.rolled.add(url)
            row = None
            if prev.declared:
                back = await self._declare(
                    url, deadline, prev.version, s.rollback_epoch, prev.digest or now.get("digest")
                )
                row = CommittedRow(prev.source, prev.version, int(s.rollback_epoch or 0), back.get("digest"))
            if not prev.paused:
                await client.resume_generation()
            self._note(run, url, "restored" if changed else "unchanged", f"epoch {s.rollback_epoch}")
            return row

        done, failed = await self._each("rolling_back", active, one, deadline)
        await self._hook(run, self.after_commit, [u for u in serving if u in done], "after_commit")
        outcome = self._outcome(run, done, failed)
        return outcome, [(u, row) for u, row in done.items() if row is not None]

    # ------------------------------------------------------------------ the result

    async def _result(self, run: _Run, deadline: float) -> TransactionResult:
        """The result, with where the fleet now is read from the workers themselves."""
        done, failed = await self._each(
            "result", self.workers, lambda u: self.client(u, deadline).get_weight_version(), deadline
        )
        p, s = run.progress, run.spec
        outcomes = []
        for url in self.workers:
            errs = run.errors.get(url, [])
            if p.phase == "aborted":
                outcome = "refused" if errs else "unchanged"
            elif url in run.resume_failed:
                outcome = "failed"
            elif p.phase in ("committed", "fenced"):
                outcome = "committed" if url in p.committed else "fenced"
            elif any(e for e in errs if e.code in ("no_rollback_source",)) or (
                url in failed
                or (
                    url in run.errors
                    and url not in run.rolled
                    and url in p.touched()
                    and (done.get(url) or {}).get("paused")
                )
            ):
                outcome = "failed"
            else:
                outcome = "rolled_back" if url in run.rolled else "unchanged"
            status = WorkerStatus(url, done.get(url), failed.get(url))
            outcomes.append(WorkerOutcome.of(url, outcome, errs, status))
        epoch = s.epoch if p.phase in ("committed", "fenced") else s.rollback_epoch
        code = None if p.phase == "committed" else {"aborted": "prepare_refused"}.get(p.phase, p.phase)
        message = "; ".join(f"{u}: {e[0].code}" for u, e in run.errors.items() if e) or None
        return TransactionResult(
            run.id, p.phase, s.version, epoch, s.expected_digest, s.policy, tuple(outcomes), code, message,
            s.min_workers,
        )  # fmt: skip


def _short(digest: Any) -> str:
    return str(digest)[:12] if digest else "unknown"


def recover(journal: Journal | str | Path, workers: Sequence[str], **options: Any) -> list[TransactionResult]:
    """Blocking :meth:`FleetCoordinator.recover` for a journal file and its workers.

    Raises ``InvalidRequest`` (``bad_journal``) when ``journal`` is a path that is not an
    existing journal: nothing is created.
    """
    if not isinstance(journal, Journal):
        journal = Journal(journal, must_exist=True)
    return FleetCoordinator(workers, journal=journal, **options).recover_sync()
