"""Fleet transactions from a sharded push: two trainer ranks (this process is rank 0, the
other a subprocess) holding FSDP shards push a plan into real worker servers on loopback,
as one transaction; one that fails on one worker rolls every worker back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import free_port, perturbed
from tests.integration.test_sharded import SPECS, held_by, others
from tests.workers import Worker
from weightsync.core.plan.layouts import TrainerLayout
from weightsync.fleet import Event, FleetCoordinator
from weightsync.fleet.plan_push import plan_transaction
from weightsync.trainer import save_checkpoint, weights_digest
from weightsync.trainer.sharded import ShardedPusher

pytestmark = [pytest.mark.slow, pytest.mark.integration]

LAYOUT = TrainerLayout.fsdp(SPECS, 2)


def run_transaction(
    workers: list[Worker], new: dict[str, torch.Tensor], seed: int, **coordinator: Any
) -> Any:
    urls = [w.url for w in workers]
    port = free_port()
    # trainer rank 1 pushes its shards once; it waits out the coordinator's prepare phase
    # (a dry run on every worker) first, which on a loaded machine can take a while
    procs = others(2, "fsdp", port, [seed], timeout_s=150)
    try:
        p = ShardedPusher(0, LAYOUT, workers=urls, master_port=port, timeout_s=90, bucket_bytes=16 << 10)
        p.connect()
        try:
            return asyncio.run(
                plan_transaction(
                    FleetCoordinator(urls, **coordinator),
                    p,
                    held_by(LAYOUT, 0, new),
                    f"plan-{seed}",
                    expected_digest=weights_digest(new),
                )
            )
        finally:
            p.close()
    finally:
        for proc in procs:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err.decode()


def setup(
    make_worker: Callable[..., Worker], tmp_path: Path
) -> tuple[list[Worker], dict[str, torch.Tensor], dict[str, str]]:
    workers = [make_worker() for _ in range(2)]
    old = {k: v.clone() for k, v in workers[0].engine.model.weights().items()}
    # each worker's last committed weights, as a checkpoint it may read (the rollback source)
    initial = {w.url: str(save_checkpoint(old, w.root / "initial")) for w in workers}
    return workers, old, initial


def test_a_plan_transaction_commits_the_full_weights_digest(
    make_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    workers, old, initial = setup(make_worker, tmp_path)
    new = perturbed(old, seed=81)
    result = run_transaction(workers, new, 81, initial_source=initial)
    assert result.ok and result.expected_digest == weights_digest(new)
    assert {(w.holds or {}).get("digest") for w in result.workers} == {weights_digest(new)}
    assert all(w.serving and w.holds and w.holds["version"] == "plan-81" for w in result.workers)


def test_a_plan_transaction_rolls_every_worker_back_when_one_fails(
    make_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    workers, old, initial = setup(make_worker, tmp_path)
    before = [w.client.get_weight_version() for w in workers]
    new = perturbed(old, seed=82)
    victim = workers[1]

    def tamper(event: Event) -> None:  # the victim's weights change behind the control plane
        if event.worker == victim.url and event.what == "loaded":
            with torch.no_grad():
                next(iter(victim.engine.model.parameters())).add_(1.0)

    result = run_transaction(workers, new, 82, initial_source=initial, on_event=tamper)
    assert result.phase == "rolled_back" and "digest_mismatch" in result.worker(victim.url).codes
    # every worker reloaded its last committed weights, attested by digest, and serves again
    assert [v["digest"] for v in result.fleet["versions"]] == [weights_digest(old)]
    assert result.fleet["serving"] == [w.url for w in workers]
    for w, b in zip(workers, before, strict=True):
        state = w.client.get_weight_version()
        assert state["digest"] == weights_digest(old) == b["digest"] and not state["torn"]
        assert state["version"] != "plan-82"
