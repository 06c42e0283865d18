"""Declarations that cannot land late, on every path that sends one: ``weightsync serve``
processes stopped (SIGSTOP) as a declaration reaches them, continued (SIGCONT) once the
fleet gave up on it and reported; a real SQLite journal.

Each path — adoption (``fleet adopt``), catch-up (``fleet add``, ``RayFleet.admit``), a
rollback's re-declaration of the old version, a recovery's roll-forward — sends its
declaration with an expiry (``not_after``) in the worker's clock; the stopped worker reads it
only after that and refuses it (``409 commit_expired``), its state unchanged.  Each docstring
says what the worker did on the code before (which sent those declarations no expiry).  The
commit itself is ``test_real_fleet.py``'s; clocks that run off, the last test here.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.fleet.test_real_fleet import RealFleet, Worker
from weightsync.fleet import Event, FleetCoordinator, Journal
from weightsync.fleet.admission import admit
from weightsync.fleet.adoption import adopt

pytestmark = pytest.mark.slow

DEADLINE_S, CLEANUP_S = 4.0, 3.0


def unpooled() -> httpx.AsyncHTTPTransport:
    """A connection per request: a request that waited on a kept-alive connection while its
    worker was stopped may be dropped unread when it runs again (uvicorn's keep-alive timer
    fires first), which would hide a late declaration by luck."""
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))


class Stopper:
    """The fleet's transport (one per worker URL): it stops ``victim`` (SIGSTOP) just before
    the first ``set_weight_version`` for it leaves, so that declaration waits, unread, in the
    stopped worker's socket; :meth:`cont` continues it and returns the line its log says
    about that declaration once it read it."""

    def __init__(self, victim: Worker) -> None:
        self.victim = victim
        self.stopped = False

    def __call__(self, url: str) -> httpx.AsyncBaseTransport:
        stopper = self

        class Stopping(httpx.AsyncHTTPTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                declaring = request.url.path.endswith("/set_weight_version")
                if url == stopper.victim.url and declaring and not stopper.stopped:
                    stopper.stopped = True
                    stopper.victim.proc.send_signal(signal.SIGSTOP)
                return await super().handle_async_request(request)

        return Stopping(limits=httpx.Limits(max_keepalive_connections=0))

    def cont(self) -> str:
        assert self.stopped, "no declaration reached the victim"
        seen = self.declarations()
        self.victim.proc.send_signal(signal.SIGCONT)
        until = time.monotonic() + 60
        while len(self.declarations()) == len(seen) and time.monotonic() < until:
            time.sleep(0.1)  # it reads the declaration that waited in its socket
        return self.declarations()[-1]

    def declarations(self) -> list[str]:
        return [x for x in self.victim.log().splitlines() if "set_weight_version" in x]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[RealFleet]:
    f = RealFleet(tmp_path, 2, logged=True)
    yield f
    for w in f.workers:
        w.close()


def expired(line: str) -> bool:
    return "refused" in line and "commit_expired" in line


def test_an_adoption_a_stopped_worker_reads_after_adopt_gave_up_is_refused(fleet: RealFleet) -> None:
    """Before: the victim read the adoption's declaration once ``adopt`` had reported it
    failed (and recorded nothing for it), and took the adopted epoch anyway."""
    victim = fleet.workers[1]
    stopper = Stopper(victim)
    coordinator = FleetCoordinator(fleet.urls, journal=fleet.journal, transport=stopper)
    adoption = asyncio.run(adopt(coordinator, deadline_s=DEADLINE_S))
    assert adoption.failed == [victim.url], adoption.to_json()
    assert set(Journal(fleet.journal).members()) == {fleet.urls[0]}
    line = stopper.cont()
    assert expired(line), victim.log()
    assert victim.state() == ("v0", None, fleet.old_digest, False, False)  # as before the adoption


def test_a_catch_up_a_stopped_worker_reads_after_add_gave_up_is_refused(fleet: RealFleet) -> None:
    """Before: the added worker read the committed declaration once ``fleet add`` had
    reported it not admitted, and claimed the commit (v1 at epoch 1) though the journal does
    not count it as a member."""
    first, victim = fleet.workers
    committed = FleetCoordinator([first.url], journal=fleet.journal, initial_source=fleet.old)
    assert asyncio.run(committed.update(fleet.new, "v1")).phase == "committed"
    stopper = Stopper(victim)
    adding = FleetCoordinator([victim.url], journal=fleet.journal, transport=stopper)
    admission = asyncio.run(admit(adding, deadline_s=DEADLINE_S))
    assert admission.failed == [victim.url], admission.to_json()
    assert set(Journal(fleet.journal).members()) == {first.url}
    line = stopper.cont()
    assert expired(line), victim.log()
    # caught up to the commit's weights, paused, but never declared: not routable, not a member
    assert victim.state() == ("v0", None, fleet.new_digest, True, False)


def test_a_rollback_declaration_a_stopped_worker_reads_after_the_rollback_is_refused(
    fleet: RealFleet,
) -> None:
    """Before: the victim, stopped as the rollback re-declared its old version, read that
    declaration once the transaction had reported ``rollback_failed`` and took the rollback
    epoch (2) for weights the fleet had reported it could not restore."""
    victim, other = fleet.workers
    stopper = Stopper(victim)

    def transport(url: str) -> httpx.AsyncBaseTransport:
        if url != other.url:
            return stopper(url)

        class Refusing(httpx.AsyncHTTPTransport):  # the other worker's verify fails: a rollback
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                if request.url.path.endswith("/verify_weights"):
                    body = {"status": "error", "code": "digest_mismatch", "message": "refused by the test"}
                    return httpx.Response(409, json=body, request=request)
                return await super().handle_async_request(request)

        return Refusing(limits=httpx.Limits(max_keepalive_connections=0))

    coordinator = FleetCoordinator(
        fleet.urls, journal=fleet.journal, initial_source=fleet.old, transport=transport, cleanup_s=CLEANUP_S
    )
    result = asyncio.run(coordinator.update(fleet.new, "v1", deadline_s=DEADLINE_S))
    assert result.phase == "rollback_failed", result.to_json()
    assert result.worker(victim.url).outcome == "failed" and "timeout" in result.worker(victim.url).codes
    assert Journal(fleet.journal).unfinished() == []
    line = stopper.cont()
    assert expired(line), victim.log()
    # its old weights are back (reloaded), paused, its label never re-declared
    assert victim.state() == ("v0", None, fleet.old_digest, True, False)
    assert other.state() == ("v0", result.epoch, fleet.old_digest, False, False)


def test_a_roll_forward_declaration_a_stopped_worker_reads_after_recover_gave_up_is_refused(
    fleet: RealFleet,
) -> None:
    """Before: the worker restarted after the commit point and stopped as ``recover`` rolled
    it forward read the commit once the recovery had reported it not resumed, and claimed
    the commit although the recovery never saw it do so."""

    class Died(BaseException):
        pass

    def die(event: Event) -> None:
        if event.worker is None and event.phase == "resuming" and event.what == "declared":
            raise Died

    dying = FleetCoordinator(fleet.urls, journal=fleet.journal, initial_source=fleet.old, on_event=die)
    with pytest.raises(Died):
        asyncio.run(dying.update(fleet.new, "v1"))
    victim = fleet.workers[0]
    victim.restart()  # it lost the commit
    stopper = Stopper(victim)
    recovering = FleetCoordinator(fleet.urls, journal=fleet.journal, transport=stopper)
    (result,) = asyncio.run(recovering.recover(cleanup_s=DEADLINE_S))
    assert result.phase == "committed", result.to_json()
    assert "timeout" in result.worker(victim.url).codes  # not resumed: the commit stands
    line = stopper.cont()
    assert expired(line), victim.log()
    assert victim.state() == ("v0", None, fleet.new_digest, True, False)  # reloaded, never declared
    assert fleet.workers[1].state() == ("v1", 1, fleet.new_digest, False, False)


def test_workers_whose_clocks_run_a_minute_ahead_and_behind_take_a_timely_commit(tmp_path: Path) -> None:
    """Before: the worker whose clock runs a minute ahead (``$WEIGHTSYNC_TEST_CLOCK_OFFSET_S``)
    refused the timely commit as expired, and the transaction rolled back."""
    fleet = RealFleet(tmp_path, 2, skew={0: 60.0, 1: -60.0})
    try:
        coordinator = FleetCoordinator(fleet.urls, journal=fleet.journal, initial_source=fleet.old)
        result = asyncio.run(coordinator.update(fleet.new, "v1"))
        assert result.phase == "committed", result.to_json()
        assert fleet.serving() == {("v1", 1, fleet.new_digest)}
    finally:
        for w in fleet.workers:
            w.close()


def test_a_late_commit_to_a_worker_whose_clock_runs_a_minute_behind_is_refused(tmp_path: Path) -> None:
    """Before: the worker whose clock runs a minute behind, stopped once it verified, read the
    commit after the rollback was reported, a minute before the commit's expiry by its own
    clock, and took it."""
    fleet = RealFleet(tmp_path, 2, logged=True, skew={1: -60.0})
    behind = fleet.workers[1]
    try:

        def stop_once_verified(event: Event) -> None:
            if event.worker == behind.url and event.what == "verified":
                behind.proc.send_signal(signal.SIGSTOP)  # before the commit phase sends anything

        coordinator = FleetCoordinator(
            fleet.urls, journal=fleet.journal, initial_source=fleet.old, on_event=stop_once_verified,
            cleanup_s=CLEANUP_S, transport=lambda url: unpooled(),
        )  # fmt: skip
        result = asyncio.run(coordinator.update(fleet.new, "v1", deadline_s=DEADLINE_S))
        assert result.phase == "rollback_failed", result.to_json()
        behind.proc.send_signal(signal.SIGCONT)
        until = time.monotonic() + 60
        while "set_weight_version" not in behind.log() and time.monotonic() < until:
            time.sleep(0.1)  # it reads the commit that waited in its socket
        line = next((x for x in behind.log().splitlines() if "set_weight_version" in x), "")
        assert expired(line), behind.log()
        assert behind.state() == ("v0", None, fleet.new_digest, True, False)  # applied, never declared
        assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}  # the other rolled back
    finally:
        for w in fleet.workers:
            w.close()
