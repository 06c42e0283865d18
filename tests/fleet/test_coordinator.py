"""The coordinator against in-process fake workers: each policy, fault and recovery path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fleet.fakes import FakeFleet, checkpoint
from weightsync.core.digest import weights_digest
from weightsync.core.errors import InvalidRequest
from weightsync.fleet import Event, FleetCoordinator, Journal, TransactionResult, WorkerOutcome, recover

OLD, NEW = "/ckpt/old", "/ckpt/new"


def fleet(n: int = 3) -> FakeFleet:
    return FakeFleet(n, {OLD: checkpoint(0), NEW: checkpoint(1)}, OLD)


def coordinator(f: FakeFleet, journal: Journal | str | Path | None = None, **kw: Any) -> FleetCoordinator:
    kw.setdefault("backoff_s", 0.001)
    return FleetCoordinator(f.urls, journal=journal, transport=f.transport, initial_source=OLD, **kw)


class Crash(BaseException):
    """The coordinator process dying at a chosen step."""


def crash_at(phase: str, what: str) -> Any:
    def hook(event: Event) -> None:
        if event.phase == phase and event.what == what:
            raise Crash

    return hook


def test_commit_declares_version_and_next_epoch_everywhere() -> None:
    f = fleet()
    result = coordinator(f).update_sync(NEW, "v1")
    assert result.ok and result.phase == "committed" and result.epoch == 1
    assert result.expected_digest == weights_digest(checkpoint(1))
    for w in f.workers.values():
        assert (w.version, w.epoch, w.digest, w.paused) == ("v1", 1, result.expected_digest, False)
    assert [w.outcome for w in result.workers] == ["committed"] * 3


def test_epoch_grows_by_one_per_committed_version() -> None:
    f = fleet(2)
    c = coordinator(f)
    assert c.update_sync(NEW, "v1").epoch == 1
    assert c.update_sync(OLD, "v2").epoch == 2
    assert {w.epoch for w in f.workers.values()} == {2}


def test_refused_prepare_changes_nothing_anywhere_and_names_the_worker() -> None:
    f = fleet()
    f[1].refuse_prepare = True
    before = [w.snapshot() for w in f.workers.values()]
    result = coordinator(f).update_sync(NEW, "v1")
    assert result.phase == "aborted" and result.code == "prepare_refused"
    assert result.worker(f.urls[1]).outcome == "refused"
    assert result.worker(f.urls[1]).code == "corrupt_checkpoint"
    assert [w.snapshot() for w in f.workers.values()] == before
    assert all("pause_generation" not in w.calls for w in f.workers.values())


def test_corrupt_checkpoint_seen_by_one_worker_only_aborts() -> None:
    f = fleet()
    paths = dict.fromkeys(f.urls, NEW) | {f.urls[2]: "/ckpt/missing"}
    before = [w.snapshot() for w in f.workers.values()]
    result = coordinator(f).update_sync(paths, "v1")
    assert result.phase == "aborted" and result.worker(f.urls[2]).code == "corrupt_checkpoint"
    assert [w.snapshot() for w in f.workers.values()] == before


def test_crash_during_apply_rolls_survivors_back_to_the_old_digest() -> None:
    f = fleet()
    old = f[0].digest
    f[1].crash_on_apply = True
    result = coordinator(f).update_sync(NEW, "v1")
    assert result.phase == "rolled_back" and not result.ok
    assert result.worker(f.urls[1]).outcome == "failed"
    assert result.worker(f.urls[1]).code == "unreachable"
    for w in (f[0], f[2]):
        assert (w.version, w.digest, w.paused) == ("v0", old, False)
    assert {result.worker(u).outcome for u in (f.urls[0], f.urls[2])} == {"rolled_back"}


def test_fence_commits_on_the_rest_and_reports_the_dead_worker() -> None:
    f = fleet()
    f[1].crash_on_apply = True
    result = coordinator(f).update_sync(NEW, "v1", policy="fence", min_workers=2)
    assert result.phase == "fenced" and result.epoch == 1
    assert result.committed and result.ok and result.to_json()["committed"] is True
    assert result.worker(f.urls[1]).outcome == "fenced"
    assert [result.worker(u).outcome for u in (f.urls[0], f.urls[2])] == ["committed"] * 2
    assert {(w.version, w.epoch, w.digest) for w in f.serving()} == {("v1", 1, weights_digest(checkpoint(1)))}


def test_fence_without_quorum_rolls_back() -> None:
    f = fleet()
    f[0].crash_on_apply = f[1].crash_on_apply = True
    result = coordinator(f).update_sync(NEW, "v1", policy="fence", min_workers=2)
    assert result.phase == "rolled_back" and not result.committed and not result.ok
    assert result.to_json()["committed"] is False
    assert (f[2].version, f[2].digest, f[2].paused) == ("v0", weights_digest(checkpoint(0)), False)


def test_hung_worker_fails_at_the_deadline_and_a_later_transaction_brings_it_back() -> None:
    f = fleet()
    f[2].hang_on_apply = True
    c = coordinator(f, cleanup_s=2.0)
    result = c.update_sync(NEW, "v1", deadline_s=0.5)
    assert result.phase == "rolled_back" and result.worker(f.urls[2]).code == "timeout"
    assert {w.version for w in f.workers.values()} == {"v0"}
    f[2].hang_on_apply = False  # SIGCONT
    assert c.update_sync(NEW, "v1").ok
    assert {(w.version, w.paused) for w in f.workers.values()} == {("v1", False)}


def test_weights_changed_outside_the_control_plane_fail_verification() -> None:
    f = fleet()
    f[0].tamper_on_apply = True
    result = coordinator(f).update_sync(NEW, "v1")
    assert result.phase == "rolled_back"
    assert result.worker(f.urls[0]).code == "digest_mismatch"
    assert {(w.version, w.digest) for w in f.workers.values()} == {("v0", weights_digest(checkpoint(0)))}


def test_unreachable_worker_is_retried_with_backoff_before_it_counts_as_failed() -> None:
    f = fleet(2)
    f[1].dead = True
    result = coordinator(f, retries=3).update_sync(NEW, "v1")
    assert result.phase == "aborted" and result.worker(f.urls[1]).code == "unreachable"


def test_coordinator_killed_between_apply_and_commit_is_recovered_to_one_version(tmp_path: Path) -> None:
    f = fleet()
    journal = tmp_path / "fleet.db"
    with pytest.raises(Crash):
        coordinator(f, journal, on_event=crash_at("committing", "verified")).update_sync(NEW, "v1")
    assert {w.paused for w in f.workers.values()} == {True}
    result = coordinator(f, Journal(journal)).recover_sync()
    assert result is not None and result.phase == "committed" and result.epoch == 1
    assert {(w.version, w.epoch, w.digest, w.paused) for w in f.workers.values()} == {
        ("v1", 1, weights_digest(checkpoint(1)), False)
    }
    assert coordinator(f, Journal(journal)).recover_sync() is None


def test_recover_rolls_back_when_a_worker_never_loaded(tmp_path: Path) -> None:
    f = fleet()
    journal = tmp_path / "fleet.db"
    with pytest.raises(Crash):
        coordinator(f, journal, on_event=crash_at("applying", "prepared")).update_sync(NEW, "v1")
    f[0].paused, f[0].hashes = True, dict(checkpoint(1))  # the one load that landed before the crash
    result = coordinator(f, Journal(journal)).recover_sync()
    assert result is not None and result.phase == "rolled_back"
    assert {(w.version, w.digest, w.paused) for w in f.workers.values()} == {
        ("v0", weights_digest(checkpoint(0)), False)
    }
    assert result.worker(f.urls[0]).outcome == "rolled_back"


def test_journal_holds_the_phase_before_the_coordinator_acts_on_it(tmp_path: Path) -> None:
    f = fleet(2)
    journal = tmp_path / "fleet.db"
    with pytest.raises(Crash):
        coordinator(f, journal, on_event=crash_at("applying", "prepared")).update_sync(NEW, "v1")
    found = Journal(journal).unfinished(frozenset({"committed", "aborted", "rolled_back", "fenced"}))
    assert found is not None and found[1] == "applying"
    assert found[2]["workers"][f.urls[0]]["previous"]["path"] == OLD
    assert all("pause_generation" not in w.calls for w in f.workers.values())


def test_recover_refuses_a_different_worker_list(tmp_path: Path) -> None:
    f = fleet(2)
    journal = tmp_path / "fleet.db"
    with pytest.raises(Crash):
        coordinator(f, journal, on_event=crash_at("applying", "prepared")).update_sync(NEW, "v1")
    with pytest.raises(InvalidRequest) as err:
        FleetCoordinator(f.urls[:1], journal=journal, transport=f.transport).recover_sync()
    assert err.value.code == "workers_mismatch"


@pytest.mark.parametrize(
    ("options", "code"),
    [
        ({"policy": "yolo"}, "invalid_value"),
        ({"pause_mode": "sometimes"}, "invalid_value"),
        ({"min_workers": 0}, "invalid_value"),
        ({"min_workers": 4}, "invalid_value"),
        ({"deadline_s": 0}, "invalid_value"),
        ({"deadline_s": 1e300}, "invalid_value"),
        ({"deadline_s": 86400.5}, "invalid_value"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(options: dict[str, Any], code: str) -> None:
    f = fleet()
    with pytest.raises(InvalidRequest) as err:
        coordinator(f).update_sync(NEW, "v1", **options)
    assert err.value.code == code
    assert all(not w.calls for w in f.workers.values())


def test_fenced_below_quorum_is_not_committed() -> None:
    workers = (WorkerOutcome("http://a:1", "committed"), WorkerOutcome("http://b:1", "fenced"))
    result = TransactionResult(1, "fenced", "v1", 1, None, "fence", workers, "fenced", None, 2)
    assert not result.committed and not result.ok and result.to_json()["committed"] is False
    assert TransactionResult(1, "fenced", "v1", 1, None, "fence", workers, "fenced", None, 1).ok


def test_recover_refuses_a_journal_file_that_does_not_exist(tmp_path: Path) -> None:
    for missing in (tmp_path / "missing.db", ":memory:"):
        with pytest.raises(InvalidRequest) as err:
            recover(missing, ["http://127.0.0.1:9"])
        assert err.value.code == "bad_journal"
    assert list(tmp_path.iterdir()) == []


def test_duplicate_worker_urls_are_refused() -> None:
    with pytest.raises(InvalidRequest) as err:
        FleetCoordinator(["http://a:1", "http://a:1/"])
    assert err.value.code == "duplicate_worker"
