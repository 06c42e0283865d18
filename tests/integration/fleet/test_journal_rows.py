"""Every table and row of the journal is validated when it is read: a damaged ``committed``
row (an epoch that is not an integer, a version that is not JSON, …) is ``bad_journal`` —
for the library, for ``weightsync fleet update`` and at the router's start-up, exit 2 —
never a traceback and never a row taken at face value.

Failed on the old code: ``Journal.committed`` raised ``ValueError`` for a text epoch and
returned the others as they were; the router and ``fleet update`` died with a traceback."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.fleet.asgi import AsgiFleet
from weightsync.core.errors import InvalidRequest
from weightsync.fleet import Journal

pytestmark = pytest.mark.integration

DAMAGE = {
    "text-epoch": "UPDATE committed SET epoch = 'x'",
    "fractional-epoch": "UPDATE committed SET epoch = 1.5",
    "zero-epoch": "UPDATE committed SET epoch = 0",
    "huge-epoch": "UPDATE committed SET epoch = 9.3e18",
    "version-not-json": "UPDATE committed SET version = 'not json'",
    "version-nan": "UPDATE committed SET version = 'NaN'",
    "version-too-deep": "UPDATE committed SET version = '" + "[" * 100_000 + "]" * 100_000 + "'",
    "version-a-blob": "UPDATE committed SET version = x'22763122'",
    "digest-a-blob": "UPDATE committed SET digest = x'00ff'",
    "source-a-blob": "UPDATE committed SET source = x'00ff'",
    "issued-epoch-text": "UPDATE meta SET value = 'x'",
    "event-phase-a-blob": "UPDATE event SET phase = x'00ff'",
    "txn-progress-not-json": "UPDATE txn SET progress = '{'",
}


@pytest.fixture
def journal(tmp_path: Path) -> tuple[Path, list[str]]:
    """A journal with one committed transaction over three workers."""
    fleet = AsgiFleet(tmp_path, 3)
    path = tmp_path / "j.db"
    result = asyncio.run(fleet.coordinator(path).update(fleet.new, "v1"))
    assert result.committed
    return path, list(fleet.urls)


def damage(path: Path, sql: str) -> None:
    with sqlite3.connect(path) as db:
        db.execute(sql)


@pytest.mark.parametrize("sql", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_row_is_bad_journal_when_the_journal_is_read(
    journal: tuple[Path, list[str]], sql: str
) -> None:
    path, urls = journal
    damage(path, sql)
    with pytest.raises(InvalidRequest) as err:
        j = Journal(path)
        j.committed(urls[0])
        j.issued_epoch()
        j.events(1)
        j.transaction(1)
    assert err.value.code == "bad_journal"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightsync.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_fleet_update_and_the_router_refuse_a_damaged_committed_row_with_exit_2(
    journal: tuple[Path, list[str]], tmp_path: Path
) -> None:
    path, urls = journal
    damage(path, DAMAGE["text-epoch"])
    workers = [a for u in urls for a in ("--worker", u)]
    update = cli(
        "fleet", "update", *workers, "--journal", str(path), "--from-disk", str(tmp_path), "--version", "v2"
    )
    router = cli("router", *workers, "--journal", str(path), "--port", "1")
    for run in (update, router):
        assert run.returncode == 2, run.stderr
        assert "bad_journal" in run.stderr and "Traceback" not in run.stderr, run.stderr
