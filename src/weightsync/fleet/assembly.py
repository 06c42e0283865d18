"""A transaction's result, assembled from its run and where the workers now are."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.core.errors import WeightSyncError
from weightsync.fleet.result import TransactionResult, WorkerOutcome, WorkerStatus
from weightsync.fleet.run import Run

__all__ = ["assemble"]


def assemble(
    run: Run, workers: Sequence[str], done: Mapping[str, Any], failed: Mapping[str, WeightSyncError]
) -> TransactionResult:
    """Each worker's outcome from what ``run`` collected and the final status reads
    (``done`` replies, ``failed`` errors by URL), in ``workers`` order."""
    p, s = run.progress, run.spec
    outcomes = []
    for url in workers:
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
