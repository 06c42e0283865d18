"""The verify phase over real worker apps in-process (ASGI): a disk transaction is attested by
the digest each worker's load took in its served memory (nothing is hashed a third time),
``live_verify`` re-hashes and so also sees a write made behind the control plane, and a worker
that predates the option is verified by a re-hash."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.integration.fleet.asgi import AsgiFleet
from weightsync.fleet.events import Event

pytestmark = pytest.mark.integration


@pytest.fixture
def fleet(tmp_path: Path) -> AsgiFleet:
    return AsgiFleet(tmp_path, 3)


def test_a_disk_transaction_is_attested_by_the_load_digests_without_a_rehash(
    fleet: AsgiFleet, tmp_path: Path, attests: list[int]
) -> None:
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert result.ok and fleet.serving() == {("v1", 1, fleet.new_digest)}
    assert [r for _, r in fleet.calls].count("verify_weights") == 3 and attests == []


def test_live_verify_catches_weights_changed_behind_the_control_plane_after_the_load(
    fleet: AsgiFleet, tmp_path: Path, attests: list[int]
) -> None:
    victim = fleet.urls[1]

    def tamper(event: Event) -> None:
        if event.worker == victim and event.what == "loaded":
            with torch.no_grad():
                next(iter(fleet.controllers[victim].engine.model.parameters())).add_(1.0)

    coordinator = fleet.coordinator(tmp_path / "j.db", on_event=tamper, live_verify=True)
    result = asyncio.run(coordinator.update(fleet.new, "v1"))
    assert result.phase == "rolled_back" and "digest_mismatch" in result.worker(victim).codes
    assert len(attests) == 3  # every worker's served weights were hashed again
    assert fleet.serving() == {("v0", result.epoch, fleet.old_digest)}


def test_a_worker_without_allow_load_digest_is_verified_by_a_rehash(
    fleet: AsgiFleet, tmp_path: Path, attests: list[int]
) -> None:
    old = fleet.urls[0]
    asked: list[dict[str, Any]] = []

    def predates_the_option(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        asked.append(body)
        if "allow_load_digest" not in body:
            return None
        error = {"status": "error", "code": "unknown_field", "message": "unknown field allow_load_digest"}
        return httpx.Response(400, json=error)

    fleet.intercept(old, "verify_weights", predates_the_option)
    result = asyncio.run(fleet.coordinator(tmp_path / "j.db").update(fleet.new, "v1"))
    assert result.ok and fleet.serving() == {("v1", 1, fleet.new_digest)}
    assert asked == [{"allow_load_digest": True}, {}] and len(attests) == 1
