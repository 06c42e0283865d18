"""``fleet adopt`` as a library call over real worker apps in-process (ASGI): what it
refuses, changing nothing, and what it records.  Each test failed on the previous code,
which had no way to adopt a fleet's state."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.fleet.asgi import AsgiFleet
from weightsync.core.errors import IllegalState
from weightsync.core.snapshot import Declared
from weightsync.fleet import Journal, adopt

pytestmark = pytest.mark.integration


def test_adopt_refuses_a_claim_no_journal_could_follow_and_changes_nothing(tmp_path: Path) -> None:
    fleet = AsgiFleet(tmp_path, 2)
    asyncio.run(fleet.controllers[fleet.urls[0]].declare(Declared("v0"), epoch=2**63 - 1))
    with pytest.raises(IllegalState) as err:
        asyncio.run(adopt(fleet.coordinator(tmp_path / "j.db")))
    assert err.value.code == "untrusted_epoch" and "restart it" in err.value.message
    assert Journal(tmp_path / "j.db").issued_epoch() == 0
    assert fleet.state(fleet.urls[1])[1] is None


def test_adopt_commits_what_the_fleet_holds_under_an_epoch_above_every_workers(tmp_path: Path) -> None:
    fleet = AsgiFleet(tmp_path, 3)
    for url, epoch in zip(fleet.urls, (4, 9, None), strict=True):
        asyncio.run(fleet.controllers[url].declare(Declared("v0"), epoch=epoch))
    done = asyncio.run(adopt(fleet.coordinator(tmp_path / "j.db"), fleet.old))
    assert done.ok and done.epoch == 10 and done.digest == fleet.old_digest
    assert fleet.serving() == {("v0", 10, fleet.old_digest)}
    journal = Journal(tmp_path / "j.db")
    assert {journal.committed(u) for u in fleet.urls} == {journal.committed(fleet.urls[0])}
    assert journal.committed(fleet.urls[0]).source == fleet.old  # type: ignore[union-attr]
    later = asyncio.run(fleet.coordinator(tmp_path / "j.db", initial_source=None).update(fleet.new, "v1"))
    assert later.ok and later.epoch == 11
