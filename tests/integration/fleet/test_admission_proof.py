"""``fleet add`` (:func:`weightsync.fleet.admission.admit`) admits a worker only on proof.

Failed on the previous code: a worker that *reported* the fleet's commit (version, epoch,
digest) was admitted as it was, though what it served had been changed behind the control
plane; and after a push-only commit a new worker was paused before admission found it had
no way to bring it there, and stayed paused.  Now each worker's served weights are re-hashed
(``verify_weights``) first: one whose weights differ is brought onto the commit from the
journal's checkpoint; one no route reaches is refused untouched (still serving), with a
message that says what to do.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.integration.fleet.asgi import AsgiFleet
from weightsync.fleet.admission import admit


@pytest.fixture
def fleet(tmp_path: Path) -> AsgiFleet:
    return AsgiFleet(tmp_path, 2)


def test_a_worker_reporting_the_commit_but_serving_other_weights_is_reloaded_before_it_is_admitted(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert result.ok
    liar = fleet.urls[1]
    engine = fleet.controllers[liar].engine
    with torch.no_grad():  # behind the control plane: it still reports the commit's digest
        next(iter(engine.model.parameters())).add_(1.0)
    assert fleet.state(liar)[:3] == ("v1", 1, fleet.new_digest)
    fleet.calls.clear()
    admission = asyncio.run(admit(fleet.coordinator(tmp_path / "j.db"), deadline_s=60))
    assert admission.ok, admission.to_json()
    reloads = [(u, r) for u, r in fleet.calls if r == "update_weights_from_disk"]
    assert reloads == [(liar, "update_weights_from_disk")]  # only the one whose proof failed
    assert "verify_weights" in {r for u, r in fleet.calls if u == fleet.urls[0]}
    fleet.calls.clear()
    # what it serves now is the commit, proven by a fresh re-hash
    for url in fleet.urls:
        assert fleet.state(url) == ("v1", 1, fleet.new_digest, False, False)
    again = asyncio.run(admit(fleet.coordinator(tmp_path / "j.db"), deadline_s=60))
    assert again.ok and "update_weights_from_disk" not in {r for _, r in fleet.calls}


def test_after_a_push_only_commit_a_worker_no_route_reaches_is_refused_untouched(
    fleet: AsgiFleet, tmp_path: Path
) -> None:
    """The commit's weights exist only in the trainer's memory (a push): the journal has no
    checkpoint of them.  A fresh worker is refused before it is paused, and keeps serving."""
    from weightsync.fleet.journal import Journal
    from weightsync.fleet.records import CommittedRow

    journal = Journal(tmp_path / "j.db")
    # the journal of a fleet whose commit a push made: a member row without a source
    journal.adopt([(fleet.urls[0], CommittedRow(None, "v1", 1, fleet.new_digest))])
    journal.close()
    fresh = fleet.urls[1]
    fleet.calls.clear()
    coordinator = fleet.coordinator(tmp_path / "j.db", initial_source=None)
    coordinator.workers = [fresh]
    admission = asyncio.run(admit(coordinator, deadline_s=60))
    assert not admission.ok
    (status,) = admission.workers
    assert status.error is not None and status.error.code == "no_catch_up_route"
    assert "a push committed them" in status.error.message and "next push or update" in status.error.message
    assert "pause_generation" not in {r for _, r in fleet.calls}
    assert fleet.state(fresh) == ("v0", None, fleet.old_digest, False, False)  # still serving as it was
