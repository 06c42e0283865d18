"""The router's journal: ``$WEIGHTSYNC_FLEET_JOURNAL`` is its default, as for the ``weightsync
fleet`` commands, and without any journal it warns at start that its commits are not
recoverable and that a later journal will not trust their epochs.

Failed on the previous code: the router ignored the variable (a fleet command on the same
journal then met workers on epochs it never issued) and ran on an in-memory journal in silence."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from tests.helpers import RouterProcess, served_workers
from weightsync.core.errors import IllegalState
from weightsync.fleet.journal import Journal

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _stopped_log(router: RouterProcess) -> list[dict]:
    router.proc.send_signal(signal.SIGINT)
    router.proc.wait(timeout=30)
    return [json.loads(line) for line in router.log().splitlines() if line.strip().startswith("{")]


def test_the_router_takes_the_fleet_commands_journal_variable_and_warns_without_a_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "fleet.db"
    with served_workers(1, "--initial-version", '"v0"') as workers:
        urls = [w.url for w in workers]
        monkeypatch.setenv("WEIGHTSYNC_FLEET_JOURNAL", str(path))
        router = RouterProcess(urls, "--log-format", "json").wait_ready()
        try:
            # The router holds the variable's journal: its lease is taken, so another
            # coordinator on that file is refused.
            assert path.exists()
            other = Journal(path)
            try:
                with pytest.raises(IllegalState) as err:
                    other.acquire()
            finally:
                other.close()
            assert err.value.code == "journal_locked", err.value
            lines = _stopped_log(router)
        finally:
            router.stop()
        assert not [line for line in lines if line.get("event") == "journal_in_memory"]

        monkeypatch.delenv("WEIGHTSYNC_FLEET_JOURNAL")
        router = RouterProcess(urls, "--log-format", "json").wait_ready()
        try:
            with httpx.Client(base_url=router.url, timeout=30) as http:
                assert http.get("/fleet/status").status_code == 200
            lines = _stopped_log(router)
        finally:
            router.stop()
        warned = [line for line in lines if line.get("event") == "journal_in_memory"]
        assert len(warned) == 1 and warned[0]["level"] == "WARNING", lines
        assert "--journal" in warned[0]["advice"] and "fleet adopt" in warned[0]["advice"]
