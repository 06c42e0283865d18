"""Fleet transactions against real ``weightsync serve`` processes on loopback.

These need the worker side of the fleet contract (docs/fleet.md, last section): ``digest``
and ``epoch`` in ``get_weight_version``, ``dry_run`` on ``update_weights_from_disk`` and
``epoch`` / ``expected_digest`` on ``set_weight_version``.  The ``fleet`` fixture probes a
real worker for them and skips, naming the missing feature, until they have landed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import TINY, WorkerProcess, perturbed
from weightsync.core.digest import weights_digest
from weightsync.engines.reference import ReferenceEngine
from weightsync.fleet import FleetCoordinator, Journal
from weightsync.trainer import save_checkpoint
from weightsync.transports.hashing import tensor_hashes

pytestmark = pytest.mark.slow


def missing_worker_feature(url: str, ckpt: Path) -> str | None:
    """Which part of the worker contract this worker lacks, or ``None``."""
    status = httpx.post(f"{url}/engine/get_weight_version", json={}).json()
    if "digest" not in status or "epoch" not in status:
        return "get_weight_version has no digest/epoch"
    dry = httpx.post(
        f"{url}/engine/update_weights_from_disk", json={"model_path": str(ckpt), "dry_run": True}
    )
    if dry.status_code != 200 or dry.json().get("dry_run") is not True:
        return "update_weights_from_disk has no dry_run"
    return None


class RealFleet:
    def __init__(self, tmp: Path, n: int) -> None:
        weights = dict(ReferenceEngine(TINY).model.weights())
        self.old = save_checkpoint(weights, tmp / "step-0")
        self.new = save_checkpoint(perturbed(weights), tmp / "step-1")
        self.old_digest = weights_digest(tensor_hashes(weights.items()))
        self.workers = [WorkerProcess("--initial-version", '"v0"') for _ in range(n)]
        for w in self.workers:
            w.wait_ready()
        self.urls = [w.url for w in self.workers]

    def coordinator(self, journal: Path | None = None, **kw: object) -> FleetCoordinator:
        return FleetCoordinator(
            self.urls, journal=journal and Journal(journal), initial_source=str(self.old), **kw
        )  # type: ignore[arg-type]

    def status(self, url: str) -> dict[str, object]:
        return dict(httpx.post(f"{url}/engine/get_weight_version", json={}, timeout=5).json())

    def greedy(self, url: str) -> list[int]:
        reply = httpx.post(
            f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 8, "temperature": 0}, timeout=30
        )
        return list(reply.json()["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def worker_features(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """Probe one real worker once: the missing part of the contract, or ``None``."""
    ckpt = save_checkpoint(
        dict(ReferenceEngine(TINY).model.weights()), tmp_path_factory.mktemp("probe") / "c"
    )
    worker = WorkerProcess().wait_ready()
    try:
        return missing_worker_feature(worker.url, ckpt)
    finally:
        worker.stop()


@pytest.fixture
def fleet(tmp_path: Path, worker_features: str | None) -> Iterator[RealFleet]:
    if worker_features:
        pytest.skip(f"worker side of the fleet contract not landed: {worker_features}")
    f = RealFleet(tmp_path, 3)
    try:
        yield f
    finally:
        for w in f.workers:
            if w.proc.poll() is None:
                os.kill(w.proc.pid, signal.SIGCONT)
            w.stop()


def test_corrupt_checkpoint_seen_by_one_worker_changes_nothing(fleet: RealFleet, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    save_checkpoint(perturbed(dict(ReferenceEngine(TINY).model.weights())), bad)
    shard = next(bad.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-7])
    before = [fleet.status(u) for u in fleet.urls]
    paths = dict.fromkeys(fleet.urls, str(fleet.new)) | {fleet.urls[1]: str(bad)}
    result = fleet.coordinator().update_sync(paths, "v1")
    assert result.phase == "aborted" and result.worker(fleet.urls[1]).outcome == "refused"
    assert [fleet.status(u) for u in fleet.urls] == before


def test_killed_worker_rollback_keeps_survivors_on_the_old_weights(fleet: RealFleet) -> None:
    outputs = [fleet.greedy(u) for u in fleet.urls]

    def kill_one(event: object) -> None:
        if getattr(event, "what", None) == "prepared":
            fleet.workers[1].proc.kill()
            fleet.workers[1].proc.wait()

    result = fleet.coordinator(on_event=kill_one).update_sync(str(fleet.new), "v1", deadline_s=30)
    assert result.phase == "rolled_back" and result.worker(fleet.urls[1]).outcome == "failed"
    for i in (0, 2):
        st = fleet.status(fleet.urls[i])
        assert (st["version"], st["digest"], st["paused"]) == ("v0", fleet.old_digest, False)
        assert fleet.greedy(fleet.urls[i]) == outputs[i]


def test_killed_worker_fence_commits_on_the_rest(fleet: RealFleet) -> None:
    def kill_one(event: object) -> None:
        if getattr(event, "what", None) == "prepared":
            fleet.workers[1].proc.kill()
            fleet.workers[1].proc.wait()

    result = fleet.coordinator(on_event=kill_one).update_sync(
        str(fleet.new), "v1", policy="fence", min_workers=2
    )
    assert result.phase == "fenced" and result.worker(fleet.urls[1]).outcome == "fenced"
    assert {fleet.status(fleet.urls[i])["epoch"] for i in (0, 2)} == {result.epoch}


def test_stopped_worker_hits_the_deadline_and_a_later_transaction_brings_it_back(fleet: RealFleet) -> None:
    os.kill(fleet.workers[2].proc.pid, signal.SIGSTOP)
    result = fleet.coordinator(cleanup_s=5).update_sync(str(fleet.new), "v1", deadline_s=5)
    assert not result.ok and result.worker(fleet.urls[2]).code in ("timeout", "unreachable")
    os.kill(fleet.workers[2].proc.pid, signal.SIGCONT)
    again = fleet.coordinator().update_sync(str(fleet.new), "v1", deadline_s=60)
    assert again.ok
    assert {fleet.status(u)["digest"] for u in fleet.urls} == {again.expected_digest}


def test_coordinator_killed_between_apply_and_commit_is_recovered(fleet: RealFleet, tmp_path: Path) -> None:
    journal = tmp_path / "fleet.db"
    script = (
        "import os, signal, sys\n"
        "from weightsync.fleet import FleetCoordinator\n"
        "def die(e):\n"
        "    if e.phase == 'committing' and e.worker is None: os.kill(os.getpid(), signal.SIGKILL)\n"
        "FleetCoordinator(sys.argv[3:], journal=sys.argv[1], on_event=die).update_sync(sys.argv[2], 'v1')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(journal), str(fleet.new), *fleet.urls], timeout=120
    )
    assert proc.returncode == -signal.SIGKILL
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "fleet", "recover", "--journal", str(journal)]
        + [a for u in fleet.urls for a in ("--worker", u)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    states = {(s["version"], s["epoch"], s["digest"]) for s in (fleet.status(u) for u in fleet.urls)}
    assert len(states) == 1
