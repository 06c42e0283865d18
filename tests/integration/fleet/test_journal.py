"""The journal as a coordinator meets it: schema, lease, unfinished transactions, recovery.

Real SQLite files and real worker apps in-process; a coordinator "dies" by an exception
out of its event hook, leaving the journal exactly as a killed process would.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from tests.integration.fleet.asgi import AsgiFleet, refuse
from weightsync.core.errors import IllegalState, InvalidRequest
from weightsync.fleet import Event, Journal

pytestmark = pytest.mark.integration


class Died(BaseException):
    pass


def die_at(phase: str, trigger: str | None = None):  # type: ignore[no-untyped-def]
    def hook(event: Event) -> None:
        if event.worker is None and event.phase == phase and (trigger is None or event.what == trigger):
            raise Died

    return hook


@pytest.fixture
def fleet(tmp_path: Path) -> AsgiFleet:
    return AsgiFleet(tmp_path, 3)


def test_a_foreign_database_is_bad_journal(tmp_path: Path) -> None:
    """Failed on the old code: any SQLite file with other tables was taken as a journal."""
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE accounts (id INTEGER)")
    with pytest.raises(InvalidRequest) as err:
        Journal(path)
    assert err.value.code == "bad_journal"


def test_a_damaged_journal_is_bad_journal(tmp_path: Path, fleet: AsgiFleet) -> None:
    """Failed on the old code: a traceback, not bad_journal."""
    path = tmp_path / "j.db"
    asyncio.run(fleet.coordinator(path).update(fleet.new, "v1"))
    with sqlite3.connect(path) as db:
        db.execute("""UPDATE txn SET spec = '{"schema": 99}', phase = 'applying'""")
    with pytest.raises(InvalidRequest) as err:
        Journal(path).unfinished()
    assert err.value.code == "bad_journal"
    (tmp_path / "junk.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(InvalidRequest) as err:
        Journal(tmp_path / "junk.db")
    assert err.value.code == "bad_journal"


def test_a_second_coordinator_on_a_journal_is_refused_naming_the_holder(
    tmp_path: Path, fleet: AsgiFleet
) -> None:
    """Failed on the old code: two coordinators both took last_epoch() + 1."""
    holder = Journal(tmp_path / "j.db")
    holder.acquire(60)
    with pytest.raises(IllegalState) as err:
        asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert err.value.code == "journal_locked" and "pid" in err.value.message
    assert fleet.calls == []
    holder.release()
    assert asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1")).ok


def test_update_refuses_while_a_transaction_is_unfinished(tmp_path: Path, fleet: AsgiFleet) -> None:
    """Failed on the old code: update never asked, and a later transaction hid the crashed one."""
    with pytest.raises(Died):
        asyncio.run(
            fleet.coordinator(tmp_path / "j.db", on_event=die_at("verifying")).update(fleet.new, "v1")
        )
    with pytest.raises(IllegalState) as err:
        asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v2"))
    assert err.value.code == "unfinished_transaction" and "weightsync fleet recover" in err.value.message


def test_recover_finds_an_older_unfinished_transaction_behind_a_newer_aborted_one(
    tmp_path: Path, fleet: AsgiFleet
) -> None:
    """Failed on the old code: unfinished() looked only at the newest row."""
    path = tmp_path / "j.db"
    with pytest.raises(Died):
        asyncio.run(fleet.coordinator(path, on_event=die_at("verifying")).update(fleet.new, "v1"))
    journal = Journal(path)  # a newer transaction that ended aborted (as the old code allowed)
    from weightsync.fleet._decide import Progress
    from weightsync.fleet.records import TransactionSpec, WorkerRecord

    spec = TransactionSpec(
        "v9", tuple(WorkerRecord(u, fleet.new) for u in fleet.urls), min_workers=2, max_unavailable=3
    )
    journal.begin(spec, Progress("aborted", "refuse"))
    journal.close()
    assert all(fleet.state(u)[3] for u in fleet.urls)  # paused on the new weights under the old label
    results = asyncio.run(fleet.coordinator(path).recover())
    assert [r.phase for r in results] == ["rolled_back"]
    assert fleet.serving() == {("v0", results[0].epoch, fleet.old_digest)}


def test_recover_past_the_commit_point_brings_a_restarted_worker_onto_the_version(
    tmp_path: Path, fleet: AsgiFleet
) -> None:
    """Failed on the old code: recover rolled back (or left) a worker that restarted."""
    path = tmp_path / "j.db"
    with pytest.raises(Died):
        asyncio.run(fleet.coordinator(path, on_event=die_at("resuming", "declared")).update(fleet.new, "v1"))
    fleet.restart(fleet.urls[1])  # initial weights, "v0", no epoch
    results = asyncio.run(fleet.coordinator(path).recover())
    assert [r.phase for r in results] == ["committed"]
    assert fleet.serving() == {("v1", 1, fleet.new_digest)}


@pytest.mark.parametrize("phase", ["applying", "verifying", "committing", "rolling_back"])
def test_recover_before_the_commit_point_rolls_back_to_one_version(
    tmp_path: Path, fleet: AsgiFleet, phase: str
) -> None:
    path = tmp_path / "j.db"
    if phase == "rolling_back":
        fleet.intercept(fleet.urls[0], "verify_weights", refuse())
    with pytest.raises(Died):
        asyncio.run(fleet.coordinator(path, on_event=die_at(phase)).update(fleet.new, "v1"))
    fleet.intercepts.clear()
    (result,) = asyncio.run(fleet.coordinator(path).recover())
    assert result.phase == "rolled_back"
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}
    assert asyncio.run(fleet.coordinator(path).recover()) == []
    assert asyncio.run(fleet.coordinator(path).update(fleet.new, "v1")).ok
