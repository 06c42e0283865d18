"""Fleet transactions from a delta and catch-up, against real ``weightsync serve`` processes,
a real SQLite journal and the real CLI: a fleet of three takes a delta as one transaction; a
worker that fails at apply leaves all three on the base; a worker restarted on the base, or
a fresh one, is caught up by the journal's deltas, proven by digest, before the router's
rule lets it serve.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.e2e.fleet.test_real_fleet import RealFleet, Worker
from weightsync.core.held import weights_digest
from weightsync.fleet import FleetCoordinator, Journal
from weightsync.fleet.catchup import newest
from weightsync.fleet.delta_channel import delta_transaction
from weightsync.router._state import Label, observe
from weightsync.trainer import save_checkpoint
from weightsync.trainer.checkpoint import checkpoint_tensors
from weightsync.trainer.delta import compute_delta, save_delta
from weightsync.transports.hashing import tensor_hashes

pytestmark = pytest.mark.slow


def sparse_step(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``weights`` with about 1 % of each tensor's elements changed (an RL step)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        flat = t.detach().clone().reshape(-1)
        picked = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
        flat[picked] += (torch.randn(picked.numel(), generator=gen) * 0.05).to(flat.dtype)
        out[name] = flat.reshape(t.shape)
    return out


def digest(weights: dict[str, torch.Tensor]) -> str:
    return weights_digest(tensor_hashes(weights.items()))


class DeltaFleet(RealFleet):
    """Workers on A (``v0``); B = A + a step, C = B + a step; deltas A→B and B→C on disk."""

    def __init__(self, tmp: Path, n: int) -> None:
        super().__init__(tmp, n)
        a, _ = checkpoint_tensors(self.old)
        b = sparse_step(a, 1)
        c = sparse_step(b, 2)
        self.digests = {"v0": digest(a), "v1": digest(b), "v2": digest(c)}
        self.ab = str(save_delta(*compute_delta(a, b, base_version="v0", target_version="v1"), tmp / "ab"))
        self.bc = str(save_delta(*compute_delta(b, c, base_version="v1", target_version="v2"), tmp / "bc"))
        self.b = str(save_checkpoint(b, tmp / "b"))
        self.tmp = tmp

    def run(self, *args: str) -> tuple[int, Any, str]:
        env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_FLEET_JOURNAL"}
        proc = self.cli(*args, "--journal", str(self.journal), "--json", env=env)
        out, err = proc.communicate(timeout=120)
        return proc.returncode, json.loads(out) if out.strip() else None, err

    def committed_label(self) -> Label:
        with Journal(self.journal, must_exist=True) as journal:
            row = newest(journal)
        assert row is not None
        return Label(True, row.version, row.epoch, row.digest)


@pytest.fixture
def three(tmp_path: Path) -> Iterator[DeltaFleet]:
    f = DeltaFleet(tmp_path, 3)
    yield f
    for w in f.workers:
        w.stop()


def test_a_fleet_of_three_takes_a_delta_as_one_transaction(three: DeltaFleet) -> None:
    code, result, err = three.run("update", "--from-delta", three.ab, "--initial-source", three.old)
    assert code == 0, (result, err)
    assert result["phase"] == "committed" and result["version"] == "v1"
    assert result["expected_digest"] == three.digests["v1"]
    assert three.serving() == {("v1", result["epoch"], three.digests["v1"])}
    with Journal(three.journal, must_exist=True) as journal:
        spec, _ = journal.transaction(result["txn"])
    assert spec.kind == "delta" and spec.delta is not None
    assert (spec.delta.base_digest, spec.delta.target_digest) == (three.digests["v0"], three.digests["v1"])
    # The next delta applies to the committed version; the one before it no longer does.
    code, result, err = three.run("update", "--from-delta", three.ab)
    assert code == 1 and result["phase"] == "aborted", (result, err)
    assert {w["code"] for w in result["workers"]} == {"base_mismatch"}
    code, result, err = three.run("update", "--from-delta", three.bc, "--version", "v2")
    assert code == 0 and three.serving() == {("v2", result["epoch"], three.digests["v2"])}, (result, err)


def test_a_delta_given_as_a_checkpoint_or_taken_twice_says_so(three: DeltaFleet) -> None:
    """Failed on the previous code: the delta given to ``--from-disk`` was refused by every
    worker as ``unknown_tensor``, and the same delta a second time was a bare ``base_mismatch``
    (``prepare_refused``, no message but the codes) advising to "fix what the refusals name"."""
    code, result, err = three.run("update", "--from-disk", three.ab, "--version", "v1")
    assert code == 1 and result["phase"] == "aborted", (result, err)
    assert {w["code"] for w in result["workers"]} == {"is_a_delta"}
    assert all("--from-delta" in w["message"] for w in result["workers"]), result
    assert three.serving() == {("v0", None, three.digests["v0"])}

    code, result, err = three.run("update", "--from-delta", three.ab, "--initial-source", three.old)
    assert code == 0, (result, err)
    code, result, err = three.run("update", "--from-delta", three.ab)
    assert code == 1 and result["phase"] == "aborted" and result["code"] == "already_at_target", (result, err)
    assert "every worker already holds the delta's target" in result["message"], result
    assert result["next_step"].startswith("nothing to do: every worker already holds the delta's target")
    assert all("already holds the delta's target" in w["message"] for w in result["workers"]), result
    assert three.serving() == {("v1", 1, three.digests["v1"])}


def _behind_the_fleets_back(fleet: DeltaFleet) -> Any:
    """A hook (before the apply pauses) that loads B into the last worker while it serves."""
    victim = fleet.workers[-1].url

    async def hook(urls: list[str]) -> None:
        async with httpx.AsyncClient(base_url=victim, timeout=60) as client:
            body = {"model_path": fleet.b, "allow_unpaused": True, "reset_prefix_cache": False}
            reply = await client.post("/engine/update_weights_from_disk", json=body)
            assert reply.status_code == 200, reply.text

    return hook


def _unreadable_to_it(fleet: DeltaFleet, paths: dict[str, str]) -> Any:
    """A hook that rewrites the last worker's own copy of the delta after its dry run."""

    async def hook(urls: list[str]) -> None:
        payload = next(Path(paths[fleet.workers[-1].url]).glob("*.safetensors"))
        raw = bytearray(payload.read_bytes())
        raw[-1] ^= 0xFF
        payload.write_bytes(bytes(raw))

    return hook


@pytest.mark.parametrize("failure", ["another_base", "delta_rewritten"])
def test_a_worker_that_fails_at_apply_leaves_all_three_on_the_base(three: DeltaFleet, failure: str) -> None:
    import shutil

    paths = dict.fromkeys(three.urls, three.ab)
    if failure == "another_base":
        hook = _behind_the_fleets_back(three)
    else:
        paths[three.urls[-1]] = str(shutil.copytree(three.ab, three.tmp / "ab-copy"))
        hook = _unreadable_to_it(three, paths)
    coordinator = FleetCoordinator(
        three.urls, journal=three.journal, initial_source=three.old, before_pause=hook
    )
    result = asyncio.run(delta_transaction(coordinator, paths))
    assert result.phase == "rolled_back", result.to_json()
    failed = {w.url: w.codes for w in result.workers if w.codes}
    assert list(failed) == [three.urls[-1]]
    assert failed[three.urls[-1]][0] == (
        "base_mismatch" if failure == "another_base" else "manifest_mismatch"
    )
    assert three.serving() == {("v0", result.epoch, three.digests["v0"])}
    assert {w.outcome for w in result.workers[:2]} == {"rolled_back"}


def test_a_restarted_worker_is_caught_up_by_the_journals_deltas_before_the_router_serves_it(
    tmp_path: Path,
) -> None:
    fleet = DeltaFleet(tmp_path, 2)
    try:
        for delta in (fleet.ab, fleet.bc):
            code, result, err = fleet.run("update", "--from-delta", delta, "--initial-source", fleet.old)
            assert code == 0, (result, err)
        behind = fleet.workers[1]
        behind.restart()  # back on A, "v0", no epoch
        committed = fleet.committed_label()
        assert committed.digest == fleet.digests["v2"]
        state = httpx.post(f"{behind.url}/engine/get_weight_version", json={}).json()
        assert state["digest"] == fleet.digests["v0"] and observe(state, committed) == "seen_uncommitted"

        fleet.urls = [behind.url]  # `fleet add --worker` names only the worker to admit
        code, result, err = fleet.run("add", "--log-level", "info")
        assert code == 0 and result["ok"], (result, err)
        state = httpx.post(f"{behind.url}/engine/get_weight_version", json={}).json()
        assert (state["version"], state["epoch"], state["digest"]) == (
            "v2",
            committed.epoch,
            fleet.digests["v2"],
        )
        assert observe(state, committed) == "seen_committed"
        # Two deltas, no full checkpoint: the journal's chain from A.
        assert "caught up by delta" in err and "caught up by disk" not in err, err
    finally:
        for w in fleet.workers:
            w.stop()


def test_fleet_add_joins_a_fresh_worker_at_the_committed_digest(tmp_path: Path) -> None:
    fleet = DeltaFleet(tmp_path, 2)
    fresh = Worker()
    try:
        fresh.wait()
        code, result, err = fleet.run("update", "--from-delta", fleet.ab, "--initial-source", fleet.old)
        assert code == 0, (result, err)
        members = fleet.urls
        fleet.urls = [fresh.url]
        code, result, err = fleet.run("add", "--log-level", "info")
        assert code == 0 and result["ok"], (result, err)
        committed = fleet.committed_label()
        state = httpx.post(f"{fresh.url}/engine/get_weight_version", json={}).json()
        assert observe(state, committed) == "seen_committed" and state["digest"] == fleet.digests["v1"]
        with Journal(fleet.journal, must_exist=True) as journal:
            assert set(journal.members()) == {*members, fresh.url}
        # The member joins the next transaction like any other.
        fleet.urls = [*members, fresh.url]
        code, result, err = fleet.run("update", "--from-delta", fleet.bc)
        assert code == 0 and result["phase"] == "committed", (result, err)
        assert {w["digest"] for w in result["workers"]} == {fleet.digests["v2"]}
    finally:
        fresh.stop()
        for w in fleet.workers:
            w.stop()
