"""The coordinator's own hash of a checkpoint (its expected digest) is bounded by the prepare:
over real worker apps in-process (ASGI) with a real SQLite journal.

A checkpoint written without per-tensor hashes is read whole to learn the digest its workers
will hold.  That read used to run on the coordinator's event loop before the dry runs were
even read, with no limit: a checkpoint of hundreds of GB held the transaction (and every
other task of the loop) for as long as the disk took.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fleet.asgi import AsgiFleet
from weightsync.fleet import Event, disk_channel

pytestmark = pytest.mark.integration


def test_a_checkpoint_hash_that_outlasts_the_prepare_is_unknown_and_the_dry_runs_decide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hash (here a disk that answers only when the test lets it) is still running when
    the transaction ends: the update committed on the dry runs' digest, and the result came
    back before the hash was let go.  Failed on the code before: the prepare waited for the
    hash, so the result could come only after the release."""
    fleet = AsgiFleet(tmp_path, 2)
    release, hashed = threading.Event(), threading.Event()

    def slow_disk(path: str) -> str | None:
        release.wait(120)
        hashed.set()
        return None

    monkeypatch.setattr(disk_channel, "checkpoint_digest", slow_disk)
    events: list[Event] = []
    coordinator = fleet.coordinator(tmp_path / "j.db", on_event=events.append)
    timer = threading.Timer(60, release.set)  # lets a waiting (old) prepare finish, and fail below
    timer.start()
    try:
        result = asyncio.run(coordinator.update(fleet.new, "v1", deadline_s=4.0))
        released_first = release.is_set()
    finally:
        release.set()
        timer.cancel()
    assert not released_first, "the transaction waited for the coordinator's hash"
    assert result.committed, result.to_json()
    assert fleet.serving() == {("v1", result.epoch, fleet.new_digest)}
    assert any(e.what == "expected digest unknown" for e in events)
    assert hashed.wait(10)  # the hash ran on in its thread and ended; nothing waited on it


def test_a_checkpoint_hash_in_time_still_catches_a_worker_that_would_load_other_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound changes nothing when the hash is quick: a coordinator that expects other
    weights than the workers' dry runs report refuses the update before any worker is
    paused (the check the hash exists for)."""
    fleet = AsgiFleet(tmp_path, 2)
    monkeypatch.setattr(disk_channel, "checkpoint_digest", lambda path: fleet.old_digest)
    coordinator = fleet.coordinator(tmp_path / "j.db")
    result = asyncio.run(coordinator.update(fleet.new, "v1", deadline_s=30.0))
    assert result.phase == "aborted" and not result.committed, result.to_json()
    assert fleet.serving() == {("v0", None, fleet.old_digest)}


def test_a_version_other_than_the_checkpoints_manifest_is_refused_at_prepare_unless_relabelled(
    tmp_path: Path,
) -> None:
    """``fleet update --version step-7`` on a checkpoint whose manifest says ``step-5``: every
    worker's dry run refuses it (version_mismatch) and nothing is paused or written; with
    ``relabel`` it commits as ``step-7``."""
    from weightsync.trainer import save_checkpoint

    fleet = AsgiFleet(tmp_path, 2)
    labelled = str(save_checkpoint(perturbed_weights(), tmp_path / "step-5", version="step-5"))
    coordinator = fleet.coordinator(tmp_path / "j.db")
    result = asyncio.run(coordinator.update(labelled, "step-7", deadline_s=30.0))
    assert not result.committed and result.phase == "aborted", result.to_json()
    assert "version_mismatch" in json.dumps(result.to_json()) and "step-5" in json.dumps(result.to_json())
    assert fleet.serving() == {("v0", None, fleet.old_digest)}
    result = asyncio.run(coordinator.update(labelled, "step-7", relabel=True, deadline_s=30.0))
    assert result.committed, result.to_json()
    assert {v for v, _, _ in fleet.serving()} == {"step-7"}


def perturbed_weights() -> dict[str, Any]:
    from tests.helpers import TINY, perturbed
    from weightsync.engines.reference import ReferenceEngine

    return perturbed(dict(ReferenceEngine(TINY).model.weights()), seed=11)
