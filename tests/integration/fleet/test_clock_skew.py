"""Workers whose clocks run a minute off the coordinator's: a late commit is still refused and
a timely one still lands.  The fleet over real worker apps in-process (ASGI), each worker's
controller on a clock of its own (``AsgiFleet(skew=...)``), a real SQLite journal.

Each docstring says how the test went on the coordinator before it sent each worker its
expiry in that worker's clock (the fleet package of the commit before, with this worker).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.integration.fleet.asgi import AsgiFleet, refuse
from weightsync.fleet import Event, Journal
from weightsync.fleet.clocks import CLOCK_MARGIN_S, CLOCK_SKEW_S

pytestmark = pytest.mark.integration

DEADLINE_S, CLEANUP_S = 3.0, 2.0


def late_commit(fleet: AsgiFleet, tmp_path: Path, victim: str) -> tuple[list[Event], float]:
    """Run an update whose ``victim`` is stopped once it verified (its commit waits in its
    socket, unread); the events, and when the coordinator sent that commit (its clock)."""
    events: list[Event] = []

    def on_event(event: Event) -> None:
        events.append(event)
        if event.worker == victim and event.what == "verified":
            fleet.stop(victim)

    coordinator = fleet.coordinator(tmp_path / "j.db", on_event=on_event, cleanup_s=CLEANUP_S)
    result = asyncio.run(coordinator.update(fleet.new, "v1", deadline_s=DEADLINE_S))
    assert result.phase == "rollback_failed", result.to_json()
    assert result.worker(victim).outcome == "failed" and "timeout" in result.worker(victim).codes
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}  # the others rolled back
    assert Journal(tmp_path / "j.db").unfinished() == []
    sent = fleet.called_at[fleet.calls.index((victim, "set_weight_version"))]
    return events, sent


def test_a_late_commit_to_a_worker_whose_clock_runs_a_minute_behind_is_refused(tmp_path: Path) -> None:
    """Failed before: the commit carried the coordinator's deadline, which the victim's clock,
    a minute behind, reached only a minute later: it took the commit it read after the
    rollback was reported (v1 at epoch 1, never committed)."""
    fleet = AsgiFleet(tmp_path, 3, skew={1: -60.0})
    victim = fleet.urls[1]
    _, sent = late_commit(fleet, tmp_path, victim)
    (route, body), *_ = [(r, b) for u, r, b in fleet.held if u == victim]  # then the rollback's
    late, *_ = fleet.cont(victim)
    assert route == "set_weight_version"
    assert (late.status_code, late.json().get("code")) == (409, "commit_expired"), late.json()
    assert fleet.state(victim) == ("v0", None, fleet.new_digest, True, False)  # applied, never declared
    assert json.loads(body)["not_after"] < sent - 60 + 30  # its expiry was in its own clock


@pytest.mark.parametrize("policy", ["rollback", "fence"])
def test_a_timely_commit_lands_on_workers_whose_clocks_run_a_minute_ahead_and_behind(
    tmp_path: Path, policy: str
) -> None:
    """Failed before: the worker a minute ahead read the commit a minute past its deadline by
    its own clock and refused it (``commit_expired``), so the transaction rolled back (or,
    under ``fence``, fenced it)."""
    fleet = AsgiFleet(tmp_path, 3, skew={0: 60.0, 1: -60.0})
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1", policy=policy))
    assert result.phase == "committed", result.to_json()
    assert fleet.serving() == {("v1", 1, fleet.new_digest)}
    assert {fleet.state(u)[:2] for u in fleet.urls} == {("v1", 1)}


def test_a_rollback_redeclares_on_a_worker_whose_clock_runs_a_minute_ahead(tmp_path: Path) -> None:
    """The rollback's re-declaration carries an expiry too, in the worker's clock: one a
    minute ahead takes it.  (Passed before too: the rollback sent no expiry then.)"""
    fleet = AsgiFleet(tmp_path, 2, skew={0: 60.0})
    fleet.intercept(fleet.urls[1], "verify_weights", refuse())
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert result.phase == "rolled_back", result.to_json()
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}
    assert result.worker(fleet.urls[0]).outcome == "rolled_back"


def test_a_worker_without_the_clock_route_is_sent_the_coordinators_deadline_and_waited_out_for_the_skew(
    tmp_path: Path,
) -> None:
    """A worker that predates the ``clock`` route (404 ``unknown_route``) is sent the
    coordinator's deadline as it is, and its commit in doubt is waited out for
    :data:`CLOCK_SKEW_S` past it, as before the route; its late commit is still refused (its
    clock is this one).  A worker that answers the route is waited out for the margin only."""
    fleet = AsgiFleet(tmp_path, 3)
    old, clocked = fleet.urls[1], fleet.urls[2]
    fleet.intercept(old, "clock", refuse("unknown_route", 404))
    events, _ = late_commit(fleet, tmp_path, old)
    doubt = [e for e in events if e.worker == old and e.what == "commit in doubt"]
    until = float(doubt[0].detail.rsplit(" ", 1)[-1])
    (_, body), *_ = [(r, b) for u, r, b in fleet.held if u == old]
    assert abs(until - json.loads(body)["not_after"] - CLOCK_SKEW_S) <= 0.001
    late, *_ = fleet.cont(old)
    assert (late.status_code, late.json()["code"]) == (409, "commit_expired"), late.json()

    fleet2 = AsgiFleet(tmp_path / "again", 3)
    events, _ = late_commit(fleet2, tmp_path / "again", clocked)
    doubt = [e for e in events if e.worker == clocked and e.what == "commit in doubt"]
    until = float(doubt[0].detail.rsplit(" ", 1)[-1])
    (_, body), *_ = [(r, b) for u, r, b in fleet2.held if u == clocked]
    # its expiry in its clock (this one) is at most the round trip of its reading early
    assert 0 <= until - CLOCK_MARGIN_S - json.loads(body)["not_after"] < 1.0
