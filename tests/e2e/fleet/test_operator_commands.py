"""The operator's fleet commands against real ``weightsync serve`` processes and the real CLI:
a journal is required, ``status --journal`` sets what each worker reports beside what was
committed, ``resume`` refuses a mislabelled worker, and ``adopt`` is the way out of
``untrusted_epoch``.  Each docstring says how the test failed on the previous code.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.fleet.test_real_fleet import RealFleet
from weightsync.fleet import FleetCoordinator

pytestmark = pytest.mark.slow


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[RealFleet]:
    f = RealFleet(tmp_path, 2)
    yield f
    for w in f.workers:
        w.stop()


def run(fleet: RealFleet, *args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_FLEET_JOURNAL"}
    proc = fleet.cli(*args, env=env)
    out, err = proc.communicate(timeout=90)
    return proc.returncode, out, err


def test_update_without_a_journal_is_refused_before_any_worker_is_touched(fleet: RealFleet) -> None:
    """Failed on the previous code: the update ran on a throwaway in-memory journal."""
    code, out, err = run(fleet, "update", "--from-disk", fleet.new, "--version", "v1")
    assert code == 2 and "journal_required" in err and "WEIGHTSYNC_FLEET_JOURNAL" in err, (out, err)
    assert {w.state() for w in fleet.workers} == {("v0", None, fleet.old_digest, False, False)}


def test_an_in_memory_transaction_then_adopt_lets_the_journal_commit_again(fleet: RealFleet) -> None:
    """Failed on the previous code: after one in-memory run every later journalled update
    was refused with untrusted_epoch, whose advice could not be followed (there was no
    adopt command, and status could not show the journal's commit)."""
    j = str(fleet.journal)
    code, out, err = run(fleet, "update", "--from-disk", fleet.new, "--version", "v1", "--journal", j,
                         "--initial-source", fleet.old)  # fmt: skip
    assert code == 0, (out, err)
    behind = asyncio.run(FleetCoordinator(fleet.urls).update(fleet.old, "v2"))  # in memory
    assert behind.ok and behind.epoch == 2
    code, out, err = run(
        fleet, "update", "--from-disk", fleet.new, "--version", "v3", "--journal", j, "--json"
    )
    refused = json.loads(out)
    assert code == 1 and refused["phase"] == "aborted", (out, err)
    assert {w["code"] for w in refused["workers"]} == {"untrusted_epoch"}
    assert "weightsync fleet adopt" in refused["next_step"]

    code, out, err = run(fleet, "status", "--journal", j, "--json")
    assert code == 0, err
    for w in json.loads(out)["workers"]:
        assert (w["version"], w["epoch"], w["version_current"]) == ("v2", 2, True)
        assert w["committed"]["version"] == "v1" and w["committed"]["epoch"] == 1
        assert w["holds_commit"] is False
    code, out, _ = run(fleet, "status", "--journal", j)
    (header,) = [line for line in out.splitlines() if line.startswith("worker ")]
    assert "committed version" in header and "current" in header and "holds commit" in header

    code, out, err = run(fleet, "adopt", "--journal", j, "--source", fleet.new, "--json")
    assert code == 1 and "initial_source_mismatch" in err, (out, err)  # they hold the old weights
    code, out, err = run(fleet, "adopt", "--journal", j, "--source", fleet.old, "--json")
    adopted = json.loads(out)
    assert code == 0 and adopted["ok"] and adopted["epoch"] == 3, (out, err)
    assert fleet.serving() == {("v2", 3, fleet.old_digest)}
    code, out, err = run(fleet, "status", "--journal", j, "--json")
    assert all(w["holds_commit"] for w in json.loads(out)["workers"])

    code, out, err = run(fleet, "update", "--from-disk", fleet.new, "--version", "v3", "--journal", j)
    assert code == 0, (out, err)
    assert fleet.serving() == {("v3", 4, fleet.new_digest)}


def test_adopt_refuses_a_fleet_whose_workers_disagree(fleet: RealFleet) -> None:
    """Failed on the previous code: there was no adopt command."""
    a = fleet.workers[0].url
    httpx.post(f"{a}/engine/pause_generation", json={}).raise_for_status()
    httpx.post(
        f"{a}/engine/update_weights_from_disk", json={"model_path": fleet.new, "weight_version": "v0"}
    ).raise_for_status()
    code, out, err = run(fleet, "adopt", "--journal", str(fleet.journal))
    assert code == 1 and "fleet_disagrees" in err, (out, err)
    assert {w.state()[1] for w in fleet.workers} == {None}  # nothing was declared


def test_resume_refuses_a_worker_whose_label_does_not_describe_its_weights(fleet: RealFleet) -> None:
    """Failed on the previous code: `fleet resume` resumed it under a label that does not
    describe its weights, with no warning."""
    victim = fleet.workers[1]
    for w in fleet.workers:
        httpx.post(f"{w.url}/engine/pause_generation", json={}).raise_for_status()
    # weights loaded without a declaration: the label "v0" no longer describes them
    reply: Any = httpx.post(f"{victim.url}/engine/update_weights_from_disk", json={"model_path": fleet.new})
    assert reply.status_code == 200, reply.text
    code, out, err = run(fleet, "resume", "--json")
    assert code == 1 and "version_not_current" in out, (out, err)
    assert fleet.workers[0].state()[3] is False  # the other one resumed
    assert victim.state()[3] is True  # the mislabelled one stays paused
    code, out, err = run(fleet, "resume", "--allow-mislabelled")
    assert code == 0, (out, err)
    assert victim.state()[3] is False


def test_status_with_the_journal_alone_lists_its_members(fleet: RealFleet) -> None:
    """``fleet status --journal J`` without ``--worker``: every member the journal lists, with
    its commit; without either, a refusal that says what to give."""
    j = str(fleet.journal)
    code, out, err = run(fleet, "update", "--from-disk", fleet.new, "--version", "v1", "--journal", j,
                         "--initial-source", fleet.old)  # fmt: skip
    assert code == 0, (out, err)
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_FLEET_JOURNAL"}
    alone = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "fleet", "status", "--journal", j, "--json"],
        capture_output=True, text=True, timeout=90, env=env,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    workers = json.loads(alone.stdout)["workers"]
    assert sorted(w["url"] for w in workers) == sorted(fleet.urls)
    assert all(w["holds_commit"] and w["committed"]["version"] == "v1" for w in workers)
    neither = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "fleet", "status"], capture_output=True, text=True, timeout=90,
        env=env,
    )  # fmt: skip
    assert neither.returncode == 2 and "--worker" in neither.stderr and "--journal" in neither.stderr
