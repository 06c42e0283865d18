"""What a fleet transaction's phases act through: the :class:`Context`.

The fan-out to the workers (each phase's scripts played on every worker at once, each
worker's lines and failures said as its script makes them), the journal (every note and
failure recorded as it is said, each step journalled before it is acted on), a rolling
update's hooks, and where a rollback restores each worker from: its last commit, else the
initial source — unless nothing could restore it, which a prepare refuses before anything is
written.  The phases themselves are in :mod:`weightsync.fleet.phases`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from weightsync.core.errors import EngineUnavailable, IllegalState, WeightSyncError
from weightsync.fleet import calls, outcomes
from weightsync.fleet._decide import Outcome, Progress
from weightsync.fleet.calls import CLOCK_SKEW_S, InDoubt, Note, Repush, Rolled, Script, Settle, Step
from weightsync.fleet.channel import Channel
from weightsync.fleet.events import Emit
from weightsync.fleet.fanout import Fanout, failure
from weightsync.fleet.journal import Journal
from weightsync.fleet.records import CommittedRow
from weightsync.fleet.transaction import Transaction

__all__ = ["Context", "Hook"]

T = TypeVar("T")
Hook = Callable[[Sequence[str]], Awaitable[None]]


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
        """Record and say each failure of ``failed`` (as ``what``), once: one said as its
        worker's script failed (see :meth:`play`) is not said again."""
        for url, exc in failed.items():
            if any(e is exc for e in tx.errors.get(url, ())):
                continue
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
            else WeightSyncError(
                f"{u}: the {p.phase} step failed locally ({what})", code="coordinator_error", url=u
            )
            for u in p.active
        }
        return self.collect(tx, {}, failed)

    async def settle(self, tx: Transaction, urls: Collection[str] | None = None) -> None:
        """Wait until no commit in doubt to ``urls`` (default: any worker) can land."""
        await tx.doubts.settle(functools.partial(self.note, tx), "commit", urls)

    def restore_source(self, url: str, channel: Channel, policy: str) -> str | None:
        """Where ``url``'s current weights load from: its last commit, else the initial source."""
        row = self.journal.committed(url)
        if row is not None and row.source:
            return row.source
        return self.initial(url, channel, policy)

    def initial(self, url: str, channel: Channel, policy: str) -> str | None:
        """The initial source ``url`` would be restored from: only where the journal knows no
        committed source for it (that one is checked at prepare, against what it holds), and
        what it committed is not a delta's target (catch-up's chain reaches it).  After a push
        committed its weights, only for a checkpoint's channel under the rollback policy: a push
        restores by re-pushing (``restore=``), the fence policy restores nothing, and asking
        either about a checkpoint of other weights would only refuse it."""
        if self.initial_source is None:
            return None
        row = self.journal.committed(url)
        if row is not None and (row.source or _chained(self.journal, row.digest)):
            return None
        pushed = row is not None and _pushed(self.journal, row.digest)
        if pushed and (channel.kind not in ("disk", "plan") or policy != "rollback"):
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
                code="no_rollback_source",
                url=url,
            )
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
        *,
        step: str,
        failed_as: str = "failed",
    ) -> tuple[dict[str, T], dict[str, WeightSyncError]]:
        """Play the phase's scripts on their workers at once; their values and errors by URL.
        ``step`` names what they do on the line that counts the answers; a worker's failure
        is recorded and said (as ``failed_as``) as its script fails, before that line."""

        def aloud(url: str, script: Script[T]) -> Script[T]:
            try:
                return (yield from script)
            except Exception as exc:
                error = failure(url, exc)
                self.failures(tx, {url: error}, failed_as)
                if error is exc:
                    raise
                raise error from exc

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

        played = {u: aloud(u, s) for u, s in scripts.items()}
        return await self.fanout.play(tx.progress.phase, played, deadline, aside, step=step)


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
