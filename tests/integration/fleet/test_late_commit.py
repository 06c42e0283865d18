"""Commits that cannot land late, deadlines that hold, and channels that cannot escape: the
fleet over real worker apps in-process (ASGI), with a real SQLite journal.

A worker the transport holds stopped takes every request sent to it and answers none until
the test continues it, as SIGSTOP and SIGCONT would (the real-process version of the first
test is in ``tests/e2e/fleet/test_real_fleet.py``).  Each docstring says whether the test
failed on the code before ``not_after``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fleet.asgi import AsgiFleet
from weightsync.fleet import Event, Journal
from weightsync.fleet.calls import CLOCK_SKEW_S
from weightsync.fleet.coordinator import RESULT_S
from weightsync.fleet.disk_channel import DiskChannel

pytestmark = pytest.mark.integration

DEADLINE_S, CLEANUP_S = 3.0, 2.0
SLACK_S = CLOCK_SKEW_S + CLEANUP_S + min(CLEANUP_S, RESULT_S)
"""What docs/fleet.md promises beyond the deadline: the clock skew a late commit is waited
out for, the rollback's own ``cleanup_s``, and the last read of every worker."""
MARGIN_S = 5.0
"""For the journal's writes and a loaded machine's scheduling, on top of the promise."""


@pytest.fixture
def fleet(tmp_path: Path) -> AsgiFleet:
    return AsgiFleet(tmp_path, 3)


def test_a_commit_a_stopped_worker_reads_after_the_rollback_is_refused(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """Failed on the old code: the declaration the stopped worker read when it ran again
    landed, so it claimed version v1 at epoch 1, which the journal rolled back."""
    victim = fleet.urls[1]
    events: list[Event] = []

    def on_event(event: Event) -> None:
        events.append(event)
        if event.worker == victim and event.what == "verified":
            fleet.stop(victim)  # it holds the new weights; the commit will sit in its socket

    coordinator = fleet.coordinator(tmp_path / "j.db", on_event=on_event, cleanup_s=CLEANUP_S)
    started = time.monotonic()
    result = asyncio.run(coordinator.update(fleet.new, "v1", deadline_s=DEADLINE_S))
    took = time.monotonic() - started
    assert result.phase == "rollback_failed" and not result.ok, result.to_json()
    assert result.worker(victim).outcome == "failed" and "timeout" in result.worker(victim).codes
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}  # the others rolled back
    assert took <= DEADLINE_S + SLACK_S + MARGIN_S, took

    replies = fleet.cont(victim)  # SIGCONT, after the rollback was reported
    assert replies[0].url.path == "/engine/set_weight_version"
    late = replies[0].json()
    assert (replies[0].status_code, late.get("code")) == (409, "commit_expired"), late
    # its weights are the new ones (applied, never committed), its label still the old one
    assert fleet.state(victim) == ("v0", None, fleet.new_digest, True, False)
    assert Journal(tmp_path / "j.db").unfinished() == []
    assert any(e.worker == victim and e.what == "commit in doubt" for e in events)


def test_a_worker_whose_commit_is_in_doubt_is_rolled_back_only_once_it_can_no_longer_land(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """The victim runs again as soon as its commit timed out, while that commit may still
    land: the rollback waits the commit's expiry (plus the margin of the reading of the
    victim's clock) out before it touches the victim, then restores it; the others are rolled
    back at once (new: the old rollback raced the late declaration, and an undeclared worker
    was never re-declared over it)."""
    victim = fleet.urls[2]
    expiry: list[float] = []

    def on_event(event: Event) -> None:
        if event.worker == victim and event.what == "verified":
            fleet.stop(victim)
        if event.worker == victim and event.what == "commit in doubt":
            fleet.stopped.discard(victim)  # it runs again: what is sent from now on reaches it
            expiry.append(float(event.detail.rsplit(" ", 1)[-1]))  # until when it may land

    coordinator = fleet.coordinator(tmp_path / "j.db", on_event=on_event, cleanup_s=CLEANUP_S)
    result = asyncio.run(coordinator.update(fleet.new, "v1", deadline_s=DEADLINE_S))
    assert result.phase == "rolled_back", result.to_json()
    assert result.worker(victim).outcome == "rolled_back"
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}
    (until,) = expiry
    commit = fleet.calls.index((victim, "set_weight_version"))
    pauses = [
        (u, t) for (u, r), t in zip(fleet.calls, fleet.called_at, strict=True) if r == "pause_generation"
    ]
    rollback = [(u, t) for u, t in pauses if t > fleet.called_at[commit]]  # the apply's came before it
    assert min(t for u, t in rollback if u == victim) >= until - 0.05
    assert max(t for u, t in rollback if u != victim) < min(t for u, t in rollback if u == victim)
    (late,) = fleet.cont(victim)  # the commit it held is read now: expired
    assert (late.status_code, late.json()["code"]) == (409, "commit_expired")
    assert fleet.state(victim) == ("v0", result.epoch, fleet.old_digest, False, False)


class Died(BaseException):
    pass


def test_a_recovery_waits_out_the_commits_its_dead_coordinator_sent(fleet: AsgiFleet, tmp_path: Path) -> None:
    """The coordinator dies while a stopped worker holds its commit; the worker runs again
    and takes it (not yet expired).  The recovery rolls every worker back, but only once no
    commit of the dead coordinator can land any more: the expiry was journalled before the
    commit was sent (new: the old journal did not know it, and the old worker never refused)."""
    victim = fleet.urls[1]

    def die_while_the_commit_waits(event: Event) -> None:
        if event.worker == victim and event.what == "verified":
            fleet.stop(victim)
        if event.phase == "committing" and event.what == "waiting":
            raise Died  # a heartbeat: the commit went out and the victim has not answered

    dying = fleet.coordinator(tmp_path / "j.db", on_event=die_while_the_commit_waits, heartbeat_s=0.2)
    with pytest.raises(Died):
        asyncio.run(dying.update(fleet.new, "v1", deadline_s=DEADLINE_S))
    ((_, spec, _),) = Journal(tmp_path / "j.db").unfinished()
    assert spec.not_after is not None
    (taken,) = fleet.cont(victim)  # it reads the commit before it expired: it lands
    assert taken.status_code == 200 and fleet.state(victim)[:2] == ("v1", 1)
    recovering = len(fleet.calls)
    (result,) = asyncio.run(fleet.coordinator(tmp_path / "j.db").recover())
    assert result.phase == "rolled_back", result.to_json()
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}
    assert min(fleet.called_at[recovering:]) >= spec.not_after + CLOCK_SKEW_S - 0.05


def test_a_hook_that_never_returns_cannot_hold_the_transaction_past_its_deadline(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """Failed on the old code: a routing hook was awaited without a bound, so the
    transaction never ended."""

    async def forever(urls: Sequence[str]) -> None:
        await asyncio.Event().wait()

    coordinator = fleet.coordinator(tmp_path / "j.db", before_pause=forever, cleanup_s=CLEANUP_S)
    started = time.monotonic()
    result = asyncio.run(coordinator.update(fleet.new, "v1", deadline_s=DEADLINE_S))
    took = time.monotonic() - started
    # the hook took the whole deadline: no worker could be paused, so none was changed
    assert result.phase == "rolled_back", result.to_json()
    assert took <= DEADLINE_S + SLACK_S + MARGIN_S, took
    assert {w.outcome for w in result.workers} == {"unchanged"}
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}
    assert Journal(tmp_path / "j.db").unfinished() == []


class Raising(DiskChannel):
    """A disk channel that fails on the coordinator's side: after it loaded every worker
    (``where="apply"``), or while saying which digest to expect (``where="digest"``)."""

    def __init__(self, paths: dict[str, str], where: str) -> None:
        super().__init__(paths)
        self.where = where

    def expected_digest(self) -> str | None:
        if self.where == "digest":
            raise RuntimeError("the manifest reader crashed")
        return super().expected_digest()

    async def apply(self, urls: Sequence[str], fan: Any, deadline: float) -> Any:
        await super().apply(urls, fan, deadline)
        raise RuntimeError("[gloo] Connection closed by peer")


def test_a_channel_that_raises_after_it_wrote_is_every_workers_outcome_and_they_are_rolled_back(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """Failed on the old code: the error escaped ``run`` with every worker paused on the new
    weights and the transaction unfinished until ``fleet recover``."""
    channel = Raising(dict.fromkeys(fleet.urls, fleet.new), "apply")
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").run(channel, "v1"))
    assert result.phase == "rolled_back", result.to_json()
    assert all("coordinator_error" in w.codes and "RuntimeError" in (w.message or "") for w in result.workers)
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}
    assert Journal(tmp_path / "j.db").unfinished() == []


def test_a_channel_that_raises_at_prepare_aborts_the_transaction(fleet: AsgiFleet, tmp_path: Path) -> None:
    """Failed on the old code: the error escaped ``run`` and left the transaction unfinished."""
    channel = Raising(dict.fromkeys(fleet.urls, fleet.new), "digest")
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").run(channel, "v1"))
    assert result.phase == "aborted", result.to_json()
    assert all("coordinator_error" in w.codes for w in result.workers)
    assert fleet.serving() == {("v0", None, fleet.old_digest)}
    assert Journal(tmp_path / "j.db").unfinished() == []
