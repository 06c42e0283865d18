"""Replies read into outcomes, by pure functions: the decider's :class:`~._decide.Outcome`
of each step, what a prepare settles (the epoch floor, the expected digest, what each
worker held), the rows a commit journals, and each worker's final outcome in the
:class:`~.result.TransactionResult`.

Two rules of the commit protocol are decided here.  *Unreachable*: a failure that says
nothing about the source (no answer, a local failure, an epoch the journal never issued)
lets a fence leave the worker out; any other failure is a refusal.  *Epoch adoption*: the
fleet epoch comes from the journal; a fresh journal takes over a running fleet at its
highest plausible epoch, and after that a worker's higher epoch is a claim the journal never
made — reported, and the worker is left out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from weightsync.core.errors import EngineUnavailable, WeightSyncError
from weightsync.fleet._decide import Outcome
from weightsync.fleet.calls import mismatch
from weightsync.fleet.events import short_digest
from weightsync.fleet.records import CommittedRow, Held, TransactionSpec
from weightsync.fleet.result import TransactionResult, WorkerOutcome, WorkerStatus
from weightsync.fleet.transaction import Transaction

Reply = dict[str, Any]

RECOVERED: Final = {
    "aborted": "nothing was written; the transaction was aborted",
    "rolled_back": "the recovery rolled back every worker it had reached",
    "rollback_failed": "the recovery's rollback did not finish",
    "committed": "it was past its commit point, so the recovery finished the commit",
    "fenced": "the recovery finished it under the fence policy",
}
"""What a recovery did, by the phase it ended in: the result's message begins with it."""

UNREACHABLE: Final = frozenset({"unreachable", "timeout", "coordinator_error", "untrusted_epoch"})
"""Failures that say nothing about the source: a fence may leave such a worker out."""

ADOPT_LIMIT: Final = 2**62
"""A fresh journal over a running fleet adopts the workers' highest epoch below this one;
anything above it is a worker's claim the journal cannot trust (and could never exceed)."""


def outcome_of(ok: Iterable[str], failed: Mapping[str, WeightSyncError]) -> Outcome:
    """The step's :class:`Outcome`: ``ok`` did it; each of ``failed`` is unreachable when its
    code is in :data:`UNREACHABLE`, else it refused."""
    refused = {u for u, exc in failed.items() if exc.code not in UNREACHABLE}
    return Outcome(ok=list(ok), refused=refused, unreachable=set(failed) - refused)


def epoch_floor(issued: int, epochs: Iterable[int]) -> int:
    """The epoch every worker's must not exceed, and the next commit's must: the highest
    the journal ``issued`` — or, from a fresh journal (0), the highest of the workers'
    ``epochs`` below :data:`ADOPT_LIMIT` (0 when none)."""
    return issued if issued else max([e for e in epochs if e < ADOPT_LIMIT], default=0)


@attrs.frozen
class Prepared:
    """What a prepare's replies settle.  ``failed``: every worker that failed, in the order
    to report them (its calls' failures, then epochs the journal never issued, then digests
    that differ); ``expected``: the digest every worker must end on; ``floor``: the epoch
    the commit's must exceed; ``spec``: with what each answering worker held."""

    spec: TransactionSpec
    outcome: Outcome
    failed: dict[str, WeightSyncError]
    expected: str | None
    floor: int

    @property
    def needs_epoch(self) -> bool:
        """Whether the transaction may go on to apply, so the commit's epoch is issued now."""
        o = self.outcome
        return not o.refused and (not o.unreachable or self.spec.policy == "fence")


def read_prepare(
    spec: TransactionSpec,
    replies: Mapping[str, tuple[Reply, Reply]],
    failed: Mapping[str, WeightSyncError],
    *,
    issued: int,
    expected: str | None,
    restore: Mapping[str, str | None],
) -> Prepared:
    """Read the prepare's ``replies`` (per worker: its state before, its dry run) and
    ``failed`` calls.  ``issued``: the journal's highest epoch; ``expected``: the digest
    the caller or the channel expects (``None``: the dry runs, which must agree, say it);
    ``restore``: per answering worker, the source a rollback would reload."""
    done, failed = dict(replies), dict(failed)
    epochs = {u: b.get("epoch") for u, (b, _) in done.items() if isinstance(b.get("epoch"), int)}
    floor = epoch_floor(issued, epochs.values())
    for url, epoch in epochs.items():
        if epoch > floor:
            done.pop(url)
            failed[url] = EngineUnavailable(
                f"{url} reports epoch {epoch}, which this journal never issued (it issued up to "
                f"{floor}): if the fleet's state is yours, take it into this journal with `weightsync "
                "fleet adopt` (it checks the workers agree first), or restart the worker",
                code="untrusted_epoch",
                url=url,
            )
    for url, (_, dry) in list(done.items()):
        digest = dry.get("digest")
        if expected is None and digest is not None:
            expected = digest
        elif digest is not None and digest != expected:
            done.pop(url)
            failed[url] = mismatch(url, f"the dry run would hold digest {digest}, expected {expected}")
    for url, (before, _) in done.items():
        held = Held.from_status(before, restore[url])
        spec = spec.with_worker(attrs.evolve(spec.worker(url), previous=held))
    return Prepared(spec, outcome_of(done, failed), failed, expected, floor)


def commit_rows(
    spec: TransactionSpec, outcome: Outcome, declared: Iterable[str]
) -> list[tuple[str, CommittedRow]]:
    """The rows the commit point journals: each worker that ``declared`` (and read back) —
    none when another failed under ``rollback`` (the transaction rolls back)."""
    if outcome.failed and spec.policy != "fence":
        return []
    assert spec.epoch is not None
    return [
        (u, CommittedRow(spec.worker(u).source, spec.version, spec.epoch, spec.expected_digest))
        for u in declared
    ]


def assemble(
    tx: Transaction, workers: Sequence[str], done: Mapping[str, Any], failed: Mapping[str, WeightSyncError]
) -> TransactionResult:
    """The result: each worker's outcome from what ``tx`` collected and the final status
    reads (``done`` replies, ``failed`` errors by URL), in ``workers`` order."""
    p, s = tx.progress, tx.spec
    outcomes = []
    for url in workers:
        errs = tx.errors.get(url, [])
        if p.phase == "aborted":
            outcome = "refused" if errs else "unchanged"
        elif url in tx.resume_failed:
            outcome = "failed"
        elif p.phase in ("committed", "fenced"):
            outcome = "committed" if url in p.committed else "fenced"
        elif any(e for e in errs if e.code in ("no_rollback_source",)) or (
            url in failed
            or (
                url in tx.errors
                and url not in tx.rolled
                and url in p.touched()
                and (done.get(url) or {}).get("paused")
            )
        ):
            outcome = "failed"
        else:
            outcome = "rolled_back" if url in tx.rolled else "unchanged"
        status = WorkerStatus(url, done.get(url), failed.get(url))
        outcomes.append(WorkerOutcome.of(url, outcome, errs, status))
    epoch = s.epoch if p.phase in ("committed", "fenced") else s.rollback_epoch
    code, message = summary(tx, done)
    return TransactionResult(
        tx.id,
        p.phase,
        s.version,
        epoch,
        s.expected_digest,
        s.policy,
        tuple(outcomes),
        code,
        message,
        s.min_workers,
    )


def summary(tx: Transaction, done: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The result's ``code`` and ``message``, from ``tx`` and where its workers ended
    (``done``: their final status replies, by URL).

    The code is the phase it ended in — ``prepare_refused`` for an abort (a dry run refused),
    ``coordinator_stopped`` for a recovery's abort (its coordinator stopped while preparing),
    ``already_at_target`` for a delta's abort where every worker already holds its target —
    and the message each worker's first error code, after what a recovery did
    (:data:`RECOVERED`) or that the delta has nothing to apply."""
    phase, s = tx.progress.phase, tx.spec
    code = None if phase == "committed" else {"aborted": "prepare_refused"}.get(phase, phase)
    message = "; ".join(f"{u}: {e[0].code}" for u, e in tx.errors.items() if e) or None
    said = None
    if tx.recovered_from is not None:
        code = "coordinator_stopped" if phase == "aborted" else code
        said = f"the coordinator stopped while {tx.recovered_from.replace('_', ' ')}: {RECOVERED.get(phase, phase)}"
    elif (
        phase == "aborted"
        and s.delta is not None
        and s.delta.target_digest != s.delta.base_digest  # a relabelling delta moves no digest
        and _all_hold(s.urls, done, s.delta.target_digest)
    ):
        code = "already_at_target"
        said = (
            f"every worker already holds the delta's target, version {json.dumps(s.delta.target_version)} "
            f"(digest {short_digest(s.delta.target_digest)}): there is nothing to apply"
        )
    if said is None:
        return code, message
    return code, said + (f" ({message})" if message else "")


def _all_hold(urls: Sequence[str], done: Mapping[str, Any], digest: str) -> bool:
    """Whether every worker of ``urls`` reported holding ``digest``, untorn."""
    return all((done.get(u) or {}).get("digest") == digest and not done[u].get("torn") for u in urls)
