"""The router's view of a fleet: baseline adoption, committed labels, stale polls, fencing."""

from __future__ import annotations

from typing import Any

from weightsync.router._state import Label
from weightsync.router.view import FleetView

URLS = ["http://a:1", "http://b:1", "http://c:1"]


def reply(
    version: Any = "v0", epoch: int | None = None, digest: str | None = "d0", **kw: Any
) -> dict[str, Any]:
    return {
        "status": "ok", "version": version, "version_declared": True, "epoch": epoch, "digest": digest,
        "paused": False, "torn": False, "update_in_flight": False, **kw,
    }  # fmt: skip


def poll(view: FleetView, replies: dict[str, dict[str, Any] | None]) -> None:
    seqs = {u: view.workers[u].seq for u in replies}
    if view.baseline.source is None:
        view.adopt(replies)
    for url, r in replies.items():
        view.observed(url, r, seqs[url], None if r else "unreachable")


def test_a_majority_of_workers_on_one_state_is_adopted_and_the_odd_one_is_fenced() -> None:
    view = FleetView(URLS)
    poll(view, {URLS[0]: reply(), URLS[1]: reply(), URLS[2]: reply(digest="other")})
    assert view.baseline.source == "workers" and view.baseline.label == Label(True, "v0", None, "d0")
    assert [view.workers[u].state for u in URLS] == ["routable", "routable", "fenced"]
    assert [c.url for c in view.candidates()[0]] == URLS[:2]


def test_no_majority_adopts_nothing_and_routes_nothing() -> None:
    view = FleetView(URLS)
    poll(view, {URLS[0]: reply(), URLS[1]: reply(digest="x"), URLS[2]: None})
    assert view.baseline.source is None and "more than half" in view.baseline.message
    assert not view.candidates()[0]
    assert [view.workers[u].state for u in URLS] == ["fenced", "fenced", "unreachable"]


def test_paused_torn_or_undigested_workers_do_not_count_towards_a_baseline() -> None:
    view = FleetView(URLS)
    poll(view, {URLS[0]: reply(paused=True), URLS[1]: reply(torn=True), URLS[2]: reply(digest=None)})
    assert view.baseline.source is None


def test_the_journal_wins_over_the_workers_and_is_per_worker() -> None:
    view = FleetView(URLS)
    view.load_journal({URLS[0]: {"version": "v1", "epoch": 1, "digest": "d1"}, URLS[1]: None, URLS[2]: None})
    assert view.baseline.source == "journal"
    poll(view, {u: reply("v1", 1, "d1") for u in URLS})
    # Only the worker the journal names has a committed label: the others are fenced.
    assert [view.workers[u].state for u in URLS] == ["routable", "fenced", "fenced"]
    assert view.newest_epoch == 1


def test_a_worker_without_a_journal_row_keeps_the_adopted_baseline() -> None:
    view = FleetView(URLS)
    poll(view, {u: reply() for u in URLS})
    view.load_journal({URLS[0]: {"version": "v1", "epoch": 1, "digest": "d1"}, URLS[1]: None, URLS[2]: None})
    poll(view, {URLS[0]: reply("v1", 1, "d1"), URLS[1]: reply(), URLS[2]: reply()})
    assert all(view.workers[u].machine.routable for u in URLS)
    assert view.newest_epoch == 1 and view.status()["version"] == "v1"


def test_a_poll_sent_before_a_router_action_is_discarded() -> None:
    view = FleetView(URLS)
    poll(view, {u: reply() for u in URLS})
    seq = view.workers[URLS[0]].seq
    view.act([URLS[0]], "pause")
    # The answer to a poll sent before the pause says "running": it must not undo the pause...
    assert view.observed(URLS[0], reply(), seq) == "paused"
    # ...and one sent after the pause, seeing it paused, is expected.
    assert view.observed(URLS[0], reply(paused=True), view.workers[URLS[0]].seq) == "paused"


def test_a_failed_request_fences_at_once_and_counts() -> None:
    seen: list[tuple[str, str]] = []
    view = FleetView(URLS, on_fence=lambda url, why: seen.append((url, why)))
    poll(view, {u: reply() for u in URLS})
    view.failed(URLS[1], "unreachable")
    view.failed(URLS[1], "unreachable")  # already out: counted once
    assert view.workers[URLS[1]].state == "unreachable" and seen == [(URLS[1], "unreachable")]
    poll(view, {u: reply() for u in URLS})
    assert view.workers[URLS[1]].machine.routable and view.workers[URLS[1]].why is None


def test_drained_workers_ignore_polls_until_released() -> None:
    view = FleetView(URLS)
    poll(view, {u: reply() for u in URLS})
    view.act(URLS[:1], "drain")
    view.act(URLS[:1], "update")
    poll(view, {URLS[0]: reply(paused=True, digest="new")})
    assert view.workers[URLS[0]].state == "updating"
    view.load_journal({URLS[0]: {"version": "v1", "epoch": 1, "digest": "new"}, URLS[1]: None, URLS[2]: None})
    view.act(URLS[:1], "release")
    poll(view, {URLS[0]: reply("v1", 1, "new")})
    assert view.workers[URLS[0]].machine.routable
