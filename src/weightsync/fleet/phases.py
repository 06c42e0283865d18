"""What each phase does, one function each: send, then collect.

Each takes the :class:`Context` the coordinator acts through and the running
:class:`~weightsync.fleet.transaction.Transaction` (already journalled at this phase), sends
each worker the phase names the calls :mod:`weightsync.fleet.calls` builds for it, reads
the replies with :mod:`weightsync.fleet.outcomes`, and returns the
:class:`~weightsync.fleet._decide.Outcome` the decider steps on with the committed rows to
journal in the same write as the next step.  Nothing here decides what comes next.

prepare (dry runs, the epoch and the expected digest), apply (pause, then the channel
loads), verify (attest the digest), commit (declare and read back), resume (the committed
batch serves; a worker that lost the commit is brought onto it first) and roll back
(restore the last committed weights, re-declare the old version under a new epoch).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Final, TypeVar

import attrs

from weightsync.core.errors import EngineUnavailable, IllegalState, WeightSyncError
from weightsync.fleet import calls, outcomes
from weightsync.fleet._decide import Outcome, Progress
from weightsync.fleet.calls import CLOCK_SKEW_S, Call, InDoubt, Note, Repush, Rolled, Script, Settle, Step
from weightsync.fleet.channel import Channel, Loaded
from weightsync.fleet.events import Emit, short_digest
from weightsync.fleet.fanout import Fanout
from weightsync.fleet.journal import Journal
from weightsync.fleet.records import CommittedRow
from weightsync.fleet.transaction import Transaction

__all__ = ["COMMIT_S", "PHASES", "Collected", "Context", "Hook"]

T = TypeVar("T")
Hook = Callable[[Sequence[str]], Awaitable[None]]
Collected = tuple[Outcome, Sequence[tuple[str, CommittedRow]]]


@attrs.frozen
class Context:
    """What the phases act through: the fan-out to the workers, the journal (whose lease a
    step renews), what to say as it happens, a rolling update's hooks, how to verify, and
    where a rollback restores from before the journal knows (``initial_source``)."""

    fanout: Fanout
    journal: Journal
    emit: Emit
    lease_s: float
    before_pause: Hook | None = None
    after_commit: Hook | None = None
    live_verify: bool = False
    initial_source: Mapping[str, str] | None = None

    def note(self, tx: Transaction, url: str | None, what: str, detail: str = "") -> None:
        self.journal.note(tx.id, tx.progress.phase, url, what, detail or None)
        self.emit(tx.progress.phase, url, what, detail)

    def advance(
        self, tx: Transaction, progress: Progress, committed: Sequence[tuple[str, CommittedRow]] = ()
    ) -> None:
        """Journal ``progress`` (and ``committed``, in the same write) before acting on it."""
        self.journal.record(tx.id, tx.spec, progress, committed)
        self.journal.renew(self.lease_s)
        tx.progress = progress
        self.emit(progress.phase, None, progress.trigger, ", ".join(progress.active))

    def collect(
        self, tx: Transaction, done: Mapping[str, Any], failed: Mapping[str, WeightSyncError]
    ) -> Outcome:
        """Note each failure and read the step's :class:`Outcome`."""
        self.failures(tx, failed, "failed")
        return outcomes.outcome_of(done, failed)

    def failures(self, tx: Transaction, failed: Mapping[str, WeightSyncError], what: str) -> None:
        for url, exc in failed.items():
            tx.fail(url, exc)
            self.note(tx, url, what, f"{exc.code}: {exc.message}")

    def crashed(self, tx: Transaction, exc: Exception) -> Outcome:
        """The :class:`Outcome` of a phase that raised (a channel's own failure, say): every
        worker it acted on failed with it, an outcome the decider sees rather than an escape
        that leaves workers paused or torn.  A commit phase's declarations are then in doubt
        (for as long as one to a worker that reports no clock)."""
        what = f"{type(exc).__name__}: {str(exc)[:300]}"
        p, s = tx.progress, tx.spec
        if p.phase == "committing" and s.not_after is not None:
            for url in p.active:
                tx.doubts.doubt(url, s.not_after + CLOCK_SKEW_S)
        failed: dict[str, WeightSyncError] = {
            u: EngineUnavailable(f"{u}: the {p.phase} step ran out of time ({what})", code="timeout", url=u)
            if isinstance(exc, TimeoutError)
            else WeightSyncError(f"{u}: the {p.phase} step failed locally ({what})", code="coordinator_error", url=u)
            for u in p.active
        }  # fmt: skip
        return self.collect(tx, {}, failed)

    async def settle(self, tx: Transaction, urls: Collection[str] | None = None) -> None:
        """Wait until no commit in doubt to ``urls`` (default: any worker) can land."""
        await tx.doubts.settle(functools.partial(self.note, tx), "commit", urls)

    def restore_source(self, url: str, channel: Channel) -> str | None:
        """Where ``url``'s current weights load from: its last commit, else the initial source."""
        row = self.journal.committed(url)
        if row is not None and row.source:
            return row.source
        return self.initial(url, channel)

    def initial(self, url: str, channel: Channel) -> str | None:
        """The initial source ``url`` would be restored from: only where the journal knows no
        committed source for it (that one is checked at prepare, against what it holds), and
        what it committed is not a delta's target (catch-up's chain reaches it).  After a push
        committed its weights, only for a checkpoint's channel: a push restores by re-pushing
        (``restore=``), and asking it about a checkpoint of other weights would refuse it."""
        if self.initial_source is None:
            return None
        row = self.journal.committed(url)
        if row is not None and (row.source or _chained(self.journal, row.digest)):
            return None
        if row is not None and _pushed(self.journal, row.digest) and channel.kind not in ("disk", "plan"):
            return None
        return self.initial_source[url]

    def unrestorable(
        self, tx: Transaction, channel: Channel, urls: Collection[str]
    ) -> dict[str, WeightSyncError]:
        """Under the rollback policy, the workers of ``urls`` serving a commit that nothing
        could restore — no checkpoint of it known (a push committed it, and no initial source
        proved to hold it), no re-push, no delta chain — each refused (``no_rollback_source``)
        before anything is written: a failure would otherwise leave them paused on weights no
        version describes.  The fence policy needs no way back.  A push without ``restore=``
        is said so (a note per worker) but not refused: the trainer's hot path, where the
        caller alone holds the tensors a rollback would need."""
        if tx.spec.policy != "rollback" or channel.restores_without_source or tx.spec.kind == "delta":
            return {}
        refused: dict[str, WeightSyncError] = {}
        for url in urls:
            held = tx.spec.worker(url).previous
            row = self.journal.committed(url)
            if held is None or held.source is not None or row is None or _chained(self.journal, row.digest):
                continue
            if channel.kind == "push":
                self.note(tx, url, "no way back", "a failure would leave it paused: push with restore=")
                continue
            refused[url] = IllegalState(
                f"{url}: serves {row.version!r} (epoch {row.epoch}), which a push committed, and no checkpoint "
                "of those weights is known: a rollback could not restore it, so nothing was written. Give "
                "the update a checkpoint of the weights it holds (the initial source), or use the fence "
                "policy (a failing worker is fenced instead of rolled back)",
                code="no_rollback_source", url=url,
            )  # fmt: skip
        return refused

    def restorer(self, tx: Transaction, also: bool = False) -> Callable[[str], calls.Restore] | None:
        """For a delta transaction, per worker the script that reaches a digest by the
        journal's chain of deltas and checkpoints (with ``also``, this transaction's delta
        too: it is past its commit point); ``None`` for any other."""
        if tx.spec.kind != "delta":
            return None
        from weightsync.fleet.catchup import Known, reach

        known = Known.of(self.journal, tx.spec if also else None)
        return lambda url: lambda now, digest, not_after: reach(url, known, now, digest, not_after)

    async def hook(
        self, tx: Transaction, hook: Hook | None, urls: Sequence[str], what: str, deadline: float
    ) -> None:
        """Await ``hook(urls)`` until ``deadline`` at most; a failure (or no end in time) is noted."""
        if hook is not None and urls:
            try:
                await asyncio.wait_for(hook(list(urls)), max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # a routing hook must not strand a transaction half-way
                self.note(tx, None, f"{what} hook failed", f"{type(exc).__name__}: {exc}")

    async def play(
        self,
        tx: Transaction,
        scripts: Mapping[str, Script[T]],
        deadline: float,
        channel: Channel | None = None,
    ) -> tuple[dict[str, T], dict[str, WeightSyncError]]:
        """Play the phase's scripts on their workers at once; their values and errors by URL."""

        async def aside(step: Step) -> Any:
            if isinstance(step, Note):
                self.note(tx, step.worker, step.what, step.detail)
            elif isinstance(step, Rolled):
                tx.rolled.add(step.worker)
            elif isinstance(step, Repush) and channel is not None:
                left = max(0.0, deadline - time.monotonic())
                try:
                    return await asyncio.wait_for(channel.repush(step.worker, deadline), left)
                except TimeoutError:
                    raise EngineUnavailable(
                        f"{step.worker}: the re-push did not end in time", code="timeout", url=step.worker
                    ) from None
            elif isinstance(step, InDoubt):
                tx.doubts.heard(step, functools.partial(self.note, tx))
            elif isinstance(step, Settle):
                await self.settle(tx, [step.worker])
            else:
                raise TypeError(f"no way to make {step!r} here")
            return None

        return await self.fanout.play(tx.progress.phase, scripts, deadline, aside)


def _chained(journal: Journal, digest: str | None) -> bool:
    """Whether ``digest`` is the target of a delta the journal committed (catch-up's chain
    reaches it: an initial source is not what restores it)."""
    return digest is not None and any(
        s.delta is not None and s.delta.target_digest == digest for s in journal.committed_specs()
    )


def _pushed(journal: Journal, digest: str | None) -> bool:
    """Whether ``digest`` is what a push the journal committed left (a trainer's memory, no
    checkpoint: an initial source is not what restores it, and a dry run of one would only
    find it holds other weights)."""
    return digest is not None and any(
        s.kind in ("push", "plan") and s.expected_digest == digest for s in journal.committed_specs()
    )


Phase = Callable[[Context, Transaction, Channel, float], Awaitable[Collected]]

COMMIT_S: Final = 30.0
"""The most a commit phase takes, within the transaction's deadline.  A declaration writes no
weights, so a worker that has not taken it by then will not (it refuses it: ``not_after``),
and a commit that got no answer is in doubt that long at most."""


async def prepare(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    scripts = {u: calls.prepare(u, channel.dry_run, ctx.initial(u, channel)) for u in tx.progress.active}
    known = tx.spec.expected_digest
    # Only a disk channel's digest may be unknown here: its dry runs report one.  The others'
    # are cheap (a record's, a plan's) or the one thing that attests a push (its tensors').
    hashing = _in_thread(channel.expected_digest) if known is None and channel.kind == "disk" else None
    replies, failed = await ctx.play(tx, scripts, deadline)
    if known is None:
        known = await _digest_by(ctx, tx, hashing, deadline) if hashing else channel.expected_digest()
    read = outcomes.read_prepare(
        tx.spec, replies, failed, issued=ctx.journal.issued_epoch(), expected=known,
        restore={u: ctx.restore_source(u, channel) for u in replies},
    )  # fmt: skip
    ctx.failures(tx, read.failed, "failed")
    tx.spec = read.spec
    refused = ctx.unrestorable(tx, channel, read.outcome.ok)
    if refused:
        ctx.failures(tx, refused, "refused")
        ok, no = read.outcome.ok - refused.keys(), read.outcome.refused | refused.keys()
        read = attrs.evolve(read, outcome=attrs.evolve(read.outcome, ok=ok, refused=no))
    if read.needs_epoch:
        epoch = ctx.journal.issue_epoch(read.floor)
        tx.spec = attrs.evolve(tx.spec, expected_digest=read.expected, epoch=epoch)
    return read.outcome, []


def _in_thread(fn: Callable[[], str | None]) -> asyncio.Future[str | None]:
    """``fn()`` in a daemon thread of its own (not the loop's executor, which ``asyncio.run``
    waits for at its end, nor one an interpreter's exit waits for), as a future of this loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str | None] = loop.create_future()

    def settle(value: str | None, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        value, error = None, None
        try:
            value = fn()
        except BaseException as exc:  # handed to the loop; the thread only reports
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an error nobody awaits is read
    threading.Thread(target=run, name="weightsync-expected-digest", daemon=True).start()
    return future


async def _digest_by(
    ctx: Context, tx: Transaction, hashing: asyncio.Future[str | None] | None, deadline: float
) -> str | None:
    """The channel's expected digest (hashed in a thread beside the dry runs: a checkpoint
    without per-tensor hashes is read whole) if it is known within half of what is left
    before ``deadline`` once the dry runs answered (the other half is the later phases'),
    else ``None``: unknown, so the workers' dry runs decide, as when the path cannot be read
    here.  A hash still running then finishes in its thread and is dropped; the loop never
    waits on it."""
    if hashing is None:
        return None
    try:
        return await asyncio.wait_for(asyncio.shield(hashing), max(0.0, deadline - time.monotonic()) / 2)
    except TimeoutError:
        ctx.note(tx, None, "expected digest unknown", "hashing the checkpoint outlasted the prepare")
        return None


async def apply(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    active = tx.progress.active
    await ctx.hook(tx, ctx.before_pause, active, "before_pause", deadline)
    mode = tx.spec.pause_mode
    paused, failed = await ctx.play(tx, {u: calls.pause_to_load(u, mode) for u in active}, deadline)

    async def fan(urls: Sequence[str], call: Callable[[str], Call]) -> Loaded:
        return await ctx.play(tx, {u: calls.built(u, call) for u in urls}, deadline)

    loaded, more = await channel.apply(list(paused), fan, deadline)
    for url, reply in loaded.items():
        ctx.note(tx, url, "loaded", f"digest {short_digest(reply.get('digest'))}")
    return ctx.collect(tx, loaded, {**failed, **more}), []


async def verify(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    expected = tx.spec.expected_digest
    scripts = {u: calls.attest(u, expected, ctx.live_verify) for u in tx.progress.active}
    done, failed = await ctx.play(tx, scripts, deadline)
    for url in done:
        ctx.note(tx, url, "verified", f"digest {short_digest(expected)}")
    return ctx.collect(tx, done, failed), []


def wall(deadline: float) -> float:
    """A ``time.monotonic()`` deadline as unix seconds on this clock (what a declaration's
    expiry is computed from)."""
    return round(time.time() + (deadline - time.monotonic()), 3)


async def commit(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    """The phase ends by the transaction's deadline or :data:`COMMIT_S` from now, whichever
    comes first, and each declaration expires then (``not_after``: this clock's, journalled
    before any is sent and kept after only while a commit is in doubt, so that a recovery
    waits it out before it undoes them; each worker is sent it in its own clock)."""
    deadline = min(deadline, time.monotonic() + COMMIT_S)
    not_after, prior = wall(deadline), tx.spec.not_after  # prior: an earlier batch's, in doubt
    tx.spec = s = attrs.evolve(tx.spec, not_after=max(not_after, prior or 0.0))
    ctx.journal.record(tx.id, s, tx.progress)
    scripts = {
        u: calls.declare(u, s.version, s.epoch, s.expected_digest, not_after) for u in tx.progress.active
    }
    done, failed = await ctx.play(tx, scripts, deadline)
    doubted = any(u in tx.doubts for u in tx.progress.active)
    tx.spec = attrs.evolve(tx.spec, not_after=s.not_after if doubted else prior)
    outcome = ctx.collect(tx, done, failed)
    rows = outcomes.commit_rows(s, outcome, done)
    for url, _ in rows:
        ctx.note(tx, url, "declared", f"epoch {s.epoch}")
    return outcome, rows


async def resume(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    """Every worker of the batch counts as done: one that could not be resumed stays
    paused and is reported (``resume_failed``), the commit stands."""
    active = tx.progress.active
    restore = ctx.restorer(tx, also=True)
    scripts = {u: calls.resume_committed(u, tx.spec, wall(deadline), restore and restore(u)) for u in active}
    done, failed = await ctx.play(tx, scripts, deadline)
    ctx.failures(tx, failed, "not resumed")
    tx.resume_failed.update(failed)
    await ctx.hook(tx, ctx.after_commit, [u for u in active if u in done], "after_commit", deadline)
    return Outcome(ok=active), []


async def roll_back(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    """Issue the rollback's epoch (once: epochs only go up), then take every touched worker
    back; a serving one is drained first and returned after, and one a commit to which is in
    doubt only once that commit can no longer land (it could undo the rollback)."""
    s = tx.spec
    if s.rollback_epoch is None:
        tx.spec = s = attrs.evolve(s, rollback_epoch=ctx.journal.issue_epoch(s.epoch or 0))
        ctx.journal.record(tx.id, s, tx.progress)
    active = tx.progress.active
    serving = [u for u in active if u in tx.progress.committed]
    await ctx.hook(tx, ctx.before_pause, serving, "before_pause", deadline)
    restore = ctx.restorer(tx)
    scripts: dict[str, Script[CommittedRow | None]] = {}
    for u in active:
        script = calls.roll_back(
            u, s, channel.restores_without_source, wall(deadline), restore and restore(u)
        )
        scripts[u] = calls.first(Settle(u), script) if u in tx.doubts else script
    done, failed = await ctx.play(tx, scripts, deadline, channel)
    await ctx.hook(tx, ctx.after_commit, [u for u in serving if u in done], "after_commit", deadline)
    outcome = ctx.collect(tx, done, failed)
    return outcome, [(u, row) for u, row in done.items() if row is not None]


PHASES: Final[Mapping[str, Phase]] = {
    "preparing": prepare, "applying": apply, "verifying": verify, "committing": commit,
    "resuming": resume, "rolling_back": roll_back,
}  # fmt: skip
