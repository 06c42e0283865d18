"""What each phase does, one function each: send, then collect.

Each takes the :class:`~weightsync.fleet.context.Context` the coordinator acts through and the running
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

import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import attrs

from weightsync.fleet import calls, outcomes
from weightsync.fleet._decide import Outcome
from weightsync.fleet.calls import Call, Note, Script, Settle
from weightsync.fleet.channel import Channel, Loaded
from weightsync.fleet.context import Context
from weightsync.fleet.events import short_digest
from weightsync.fleet.expected_digest import digest_by, in_thread
from weightsync.fleet.records import CommittedRow
from weightsync.fleet.transaction import Transaction

__all__ = ["COMMIT_S", "PHASES", "Collected"]

T = TypeVar("T")
Collected = tuple[Outcome, Sequence[tuple[str, CommittedRow]]]


Phase = Callable[[Context, Transaction, Channel, float], Awaitable[Collected]]

COMMIT_S: Final = 30.0
"""The most a commit phase takes, within the transaction's deadline.  A declaration writes no
weights, so a worker that has not taken it by then will not (it refuses it: ``not_after``),
and a commit that got no answer is in doubt that long at most."""


async def prepare(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    scripts = {
        u: calls.prepare(u, channel.dry_run, ctx.initial(u, channel, tx.spec.policy))
        for u in tx.progress.active
    }
    known = tx.spec.expected_digest
    # Only a disk channel's digest may be unknown here: its dry runs report one.  The others'
    # are cheap (a record's, a plan's) or the one thing that attests a push (its tensors').
    hashing = in_thread(channel.expected_digest) if known is None and channel.kind == "disk" else None
    replies, failed = await ctx.play(tx, scripts, deadline, step="dry run")
    if hashing is not None and replies:  # with no dry run to hold to it, nobody waits for it
        say = functools.partial(ctx.note, tx, None)
        known = await digest_by(ctx.fanout, tx.progress.phase, hashing, deadline, say)
    elif known is None and hashing is None:
        known = channel.expected_digest()
    read = outcomes.read_prepare(
        tx.spec,
        replies,
        failed,
        issued=ctx.journal.issued_epoch(),
        expected=known,
        restore={u: ctx.restore_source(u, channel, tx.spec.policy) for u in replies},
    )
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


async def apply(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    active = tx.progress.active
    await ctx.hook(tx, ctx.before_pause, active, "before_pause", deadline)
    mode = tx.spec.pause_mode
    paused, failed = await ctx.play(
        tx, {u: calls.pause_to_load(u, mode) for u in active}, deadline, step="pause"
    )
    said: set[str] = set()

    async def fan(urls: Sequence[str], call: Callable[[str], Call]) -> Loaded:
        said.update(urls)  # each worker's line as it loads, before the line counting them
        scripts = {u: _said(u, calls.built(u, call), "loaded", _digest_of) for u in urls}
        return await ctx.play(tx, scripts, deadline, step="load")

    loaded, more = await channel.apply(list(paused), fan, deadline)
    for url, reply in loaded.items():  # a push loads the whole group in one call: no line yet
        if url not in said:
            ctx.note(tx, url, "loaded", _digest_of(reply))
    return ctx.collect(tx, loaded, {**failed, **more}), []


def _said(url: str, script: Script[T], what: str, detail: Callable[[T], str]) -> Script[T]:
    """``script``, then a :class:`Note` of what it did (``detail`` of its value), said as the
    worker's script ends: before the line counting every worker's answer, not after it."""
    value = yield from script
    yield Note(url, what, detail(value))
    return value


def _digest_of(reply: Mapping[str, Any]) -> str:
    return f"digest {short_digest(reply.get('digest'))}"


async def verify(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    expected = tx.spec.expected_digest
    scripts = {
        u: _said(u, calls.attest(u, expected, ctx.live_verify), "verified", _digest_of)
        for u in tx.progress.active
    }
    done, failed = await ctx.play(tx, scripts, deadline, step="verify")
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
    epoch = f"epoch {s.epoch}"
    declaring = {
        u: calls.declare(u, s.version, s.epoch, s.expected_digest, not_after) for u in tx.progress.active
    }
    scripts = {u: _said(u, script, "declared", lambda _: epoch) for u, script in declaring.items()}
    done, failed = await ctx.play(tx, scripts, deadline, step="declare")
    doubted = any(u in tx.doubts for u in tx.progress.active)
    tx.spec = attrs.evolve(tx.spec, not_after=s.not_after if doubted else prior)
    outcome = ctx.collect(tx, done, failed)
    return outcome, outcomes.commit_rows(s, outcome, done)


async def resume(ctx: Context, tx: Transaction, channel: Channel, deadline: float) -> Collected:
    """Every worker of the batch counts as done: one that could not be resumed stays
    paused and is reported (``resume_failed``), the commit stands."""
    active = tx.progress.active
    restore = ctx.restorer(tx, also=True)
    scripts = {u: calls.resume_committed(u, tx.spec, wall(deadline), restore and restore(u)) for u in active}
    done, failed = await ctx.play(tx, scripts, deadline, step="resume", failed_as="not resumed")
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
    done, failed = await ctx.play(tx, scripts, deadline, channel, step="roll back")
    await ctx.hook(tx, ctx.after_commit, [u for u in serving if u in done], "after_commit", deadline)
    outcome = ctx.collect(tx, done, failed)
    return outcome, [(u, row) for u, row in done.items() if row is not None]


PHASES: Final[Mapping[str, Phase]] = {
    "preparing": prepare, "applying": apply, "verifying": verify, "committing": commit,
    "resuming": resume, "rolling_back": roll_back,
}  # fmt: skip
