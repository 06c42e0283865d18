"""Weights changed on one worker outside the control plane: the verify phase catches it.

Real reference workers served over loopback HTTP in this process, so a test can write into
one worker's parameters directly (as a stray process, a bug or an attacker would), between
its load and the coordinator's verify phase.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import TINY, perturbed
from weightsync.core import Controller
from weightsync.core.digest import weights_digest
from weightsync.engines.reference import ReferenceEngine
from weightsync.fleet import Event, FleetCoordinator
from weightsync.trainer import save_checkpoint
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.http import ServerThread, create_app


class InProcessFleet:
    def __init__(self, root: Path, n: int) -> None:
        self.engines = [ReferenceEngine(TINY, allowed_weight_dirs=[root]) for _ in range(n)]
        self.servers = [ServerThread(create_app(Controller(e))).start() for e in self.engines]
        self.urls = [s.url for s in self.servers]
        weights = dict(self.engines[0].model.weights())
        self.old = save_checkpoint(weights, root / "step-0")
        self.new = save_checkpoint(perturbed(weights), root / "step-1")
        self.old_digest = weights_digest(tensor_hashes(weights.items()))

    def tamper_after_load(self, i: int) -> object:
        def hook(event: Event) -> None:
            if event.worker == self.urls[i] and event.what == "loaded":
                with torch.no_grad():
                    self.engines[i].model.weights()["model.norm.weight"].add_(0.5)

        return hook

    def status(self, url: str) -> dict[str, object]:
        return dict(httpx.post(f"{url}/engine/get_weight_version", json={}, timeout=10).json())

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[InProcessFleet]:
    f = InProcessFleet(tmp_path, 3)
    try:
        yield f
    finally:
        f.stop()


def test_weights_changed_outside_the_control_plane_fail_verify_and_roll_back(fleet: InProcessFleet) -> None:
    coordinator = FleetCoordinator(
        fleet.urls, initial_source=str(fleet.old), on_event=fleet.tamper_after_load(1)
    )
    result = coordinator.update_sync(str(fleet.new), "v1", deadline_s=60)
    assert result.phase == "rolled_back"
    assert result.worker(fleet.urls[1]).code == "digest_mismatch"
    for url in fleet.urls:  # the tampered worker was reloaded too: its weights are the old ones again
        st = fleet.status(url)
        assert (st["digest"], st["paused"], st["torn"]) == (fleet.old_digest, False, False)
        verified = httpx.post(f"{url}/engine/verify_weights", json={}, timeout=10).json()
        assert verified["match"] is True


def test_weights_changed_outside_the_control_plane_are_fenced(fleet: InProcessFleet) -> None:
    coordinator = FleetCoordinator(
        fleet.urls, initial_source=str(fleet.old), on_event=fleet.tamper_after_load(2)
    )
    result = coordinator.update_sync(str(fleet.new), "v1", policy="fence", min_workers=2, deadline_s=60)
    assert result.phase == "fenced"
    assert result.worker(fleet.urls[2]).outcome == "fenced"
    assert result.worker(fleet.urls[2]).code == "digest_mismatch"
    committed = [fleet.status(u) for u in fleet.urls[:2]]
    assert {(s["version"], s["epoch"], s["digest"]) for s in committed} == {
        ("v1", result.epoch, result.expected_digest)
    }
    assert fleet.status(fleet.urls[2])["version"] != "v1"
