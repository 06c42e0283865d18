"""Replies read into outcomes: which failure is unreachable, how a fresh journal adopts the
fleet's epoch, how the dry runs settle the digest, and what a commit journals.  Pure
functions over hand-made replies; no HTTP, no journal."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.core.errors import EngineUnavailable, IllegalState, InvalidRequest, WeightSyncError
from weightsync.fleet._decide import Outcome
from weightsync.fleet.outcomes import ADOPT_LIMIT, commit_rows, epoch_floor, outcome_of, read_prepare
from weightsync.fleet.records import CommittedRow, Held, TransactionSpec, WorkerRecord

A, B, C = "http://a:80", "http://b:80", "http://c:80"
OLD, NEW = "0" * 16, "1" * 16


def spec(policy: str = "rollback", **kw: Any) -> TransactionSpec:
    workers = tuple(WorkerRecord(u, f"/ckpt/new-{u[-4]}") for u in (A, B, C))
    return TransactionSpec("v1", workers, policy=policy, min_workers=2, max_unavailable=3, **kw)


def state(epoch: int | None = None, digest: str = OLD) -> dict[str, Any]:
    return {"version": "v0", "version_declared": True, "epoch": epoch, "digest": digest, "paused": False}


def prepared(epochs: dict[str, int | None], dry: dict[str, str | None] | None = None) -> dict[str, Any]:
    dry = dry or {}
    return {u: (state(e), {"digest": dry.get(u, NEW)}) for u, e in epochs.items()}


RESTORE = {A: "/ckpt/old-a", B: None, C: "/ckpt/old-c"}


@pytest.mark.parametrize("code", ["unreachable", "timeout", "coordinator_error", "untrusted_epoch"])
def test_a_failure_that_says_nothing_about_the_source_is_unreachable(code: str) -> None:
    failed: dict[str, WeightSyncError] = {B: EngineUnavailable("no answer", code=code)}
    assert outcome_of([A], failed) == Outcome(ok=[A], unreachable=[B])


@pytest.mark.parametrize(
    "code", ["digest_mismatch", "bad_checkpoint", "weights_torn", "commit_not_read_back"]
)
def test_any_other_failure_is_a_refusal(code: str) -> None:
    failed: dict[str, WeightSyncError] = {
        B: IllegalState("no", code=code),
        C: InvalidRequest("no", code=code),
    }
    assert outcome_of([A], failed) == Outcome(ok=[A], refused=[B, C])


def test_a_fresh_journal_adopts_the_highest_plausible_epoch_and_then_trusts_only_its_own() -> None:
    assert epoch_floor(0, [3, 7, ADOPT_LIMIT, 2**63 - 1]) == 7
    assert epoch_floor(0, []) == 0
    assert epoch_floor(9, [3, 12]) == 9  # once it issued, the workers' claims never move it


def test_a_fresh_journal_over_a_running_fleet_adopts_its_epoch_and_leaves_out_an_implausible_one() -> None:
    read = read_prepare(
        spec("fence"), prepared({A: 4, B: 7, C: 2**63 - 1}), {}, issued=0, expected=NEW, restore=RESTORE
    )
    assert read.floor == 7
    assert read.outcome == Outcome(ok=[A, B], unreachable=[C])
    assert read.failed[C].code == "untrusted_epoch" and "never issued" in read.failed[C].message
    assert read.needs_epoch  # fence goes on without C


def test_a_worker_ahead_of_the_journals_epoch_is_left_out() -> None:
    read = read_prepare(spec(), prepared({A: 3, B: 3, C: 4}), {}, issued=3, expected=NEW, restore=RESTORE)
    assert read.floor == 3 and read.outcome.unreachable == {C}
    assert not read.needs_epoch  # under rollback a worker left out aborts: no epoch is issued


def test_an_unreachable_worker_is_reported_after_the_calls_failures_and_holds_no_record() -> None:
    down = EngineUnavailable("no answer", code="unreachable", url=B)
    read = read_prepare(
        spec("fence"), prepared({A: 1, C: 2**63 - 1}), {B: down}, issued=1, expected=NEW, restore=RESTORE
    )
    assert read.outcome == Outcome(ok=[A], unreachable=[B, C])
    assert list(read.failed) == [B, C]  # the calls' failures first, then the untrusted epochs
    assert read.spec.worker(B).previous is None and read.spec.worker(C).previous is None


def test_what_each_answering_worker_held_is_recorded_with_where_it_restores_from() -> None:
    read = read_prepare(spec(), prepared({A: 2, B: None, C: 2}), {}, issued=2, expected=NEW, restore=RESTORE)
    assert read.spec.worker(A).previous == Held("v0", True, 2, OLD, False, False, "/ckpt/old-a")
    assert read.spec.worker(B).previous == Held("v0", True, None, OLD, False, False, None)
    assert read.needs_epoch and read.outcome == Outcome(ok=[A, B, C])


def test_the_dry_runs_say_the_digest_when_nobody_knows_it_and_must_agree() -> None:
    read = read_prepare(
        spec(), prepared({A: None, B: None, C: None}, {A: None, B: NEW, C: OLD}), {}, issued=0, expected=None,
        restore=RESTORE,
    )  # fmt: skip
    assert read.expected == NEW
    assert read.outcome == Outcome(ok=[A, B], refused=[C]) and read.failed[C].code == "digest_mismatch"
    assert not read.needs_epoch


def test_a_dry_run_that_differs_from_the_expected_digest_is_refused() -> None:
    read = read_prepare(
        spec(), prepared({A: None, B: None}, {B: OLD}), {}, issued=0, expected=NEW, restore=RESTORE
    )
    assert read.outcome.refused == {B} and read.expected == NEW


def test_the_commit_point_journals_every_declared_worker_with_the_new_version_epoch_and_digest() -> None:
    s = spec("fence", epoch=8, expected_digest=NEW)
    assert commit_rows(s, Outcome(ok=[A, B, C]), [A, B, C]) == [
        (u, CommittedRow(f"/ckpt/new-{u[-4]}", "v1", 8, NEW)) for u in (A, B, C)
    ]
    assert [u for u, _ in commit_rows(s, Outcome(ok=[A, B], refused=[C]), [A, B])] == [A, B]


def test_a_failed_commit_under_rollback_journals_no_committed_worker() -> None:
    s = spec("rollback", epoch=8, expected_digest=NEW)
    assert commit_rows(s, Outcome(ok=[A, B], unreachable=[C]), [A, B]) == []
