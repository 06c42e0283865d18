"""A router that follows a journal another writer keeps (``follow_journal``, ``weightsync
router --follow-journal``): a real router in process in front of two real workers, and a
coordinator beside it committing to the same journal file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import perturbed
from tests.integration.test_http import wait_until
from tests.workers import Worker
from weightsync.core.errors import IllegalState, InvalidRequest
from weightsync.fleet import FleetCoordinator
from weightsync.router import Router
from weightsync.router.app import create_router_app
from weightsync.serve import ServerThread
from weightsync.trainer import save_checkpoint, weights_digest

pytestmark = pytest.mark.slow


def test_a_following_router_routes_by_the_other_writers_commits_and_runs_no_update(
    make_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    workers = [make_worker() for _ in range(2)]
    urls = [w.url for w in workers]
    new = perturbed(dict(workers[0].engine.model.weights()), seed=1)
    paths = {w.url: str(save_checkpoint(new, w.root / "step-1")) for w in workers}
    journal = tmp_path / "fleet.db"
    router = Router(urls, journal=journal, follow_journal=True, poll_interval_s=0.05, request_timeout_s=30)
    with ServerThread(create_router_app(router)) as server:

        def status() -> dict[str, Any]:
            return dict(httpx.get(f"{server.url}/fleet/status", timeout=10).json())

        # the router holds no lease: the writer beside it runs its transaction
        result = FleetCoordinator(urls, journal=journal).update_sync(paths, "step-1")
        assert result.ok, result.to_json()
        # and the router reads that commit at its next poll: both route at the new epoch
        wait_until(lambda: all(w["routable"] and w["epoch"] == result.epoch for w in status()["workers"]))
        body = {"prompt": "hi", "max_tokens": 2, "weight_version": "step-1", "min_weight_epoch": result.epoch}
        routed = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert routed.status_code == 200 and routed.json()["weight_epoch"] == result.epoch, routed.text
        # a fleet update through it is refused, and changes nothing
        for route, update in (
            ("update_weights_from_disk", {"model_path": paths[urls[0]], "weight_version": "step-2"}),
            ("set_weight_version", {"weight_version": "relabelled"}),
        ):
            refused = httpx.post(f"{server.url}/fleet/{route}", json=update, timeout=60)
            assert refused.status_code == 409 and refused.json()["code"] == "journal_followed", refused.text
        held = [w.client.get_weight_version() for w in workers]
        assert {(h["version"], h["epoch"], h["digest"]) for h in held} == {
            ("step-1", result.epoch, weights_digest(new))
        }


def test_a_router_that_does_not_follow_keeps_the_writer_beside_it_out(
    make_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    """The default stays: the router is the journal's one writer."""
    worker = make_worker()
    journal = tmp_path / "fleet.db"
    router = Router([worker.url], journal=journal)
    try:
        with pytest.raises(IllegalState) as locked:
            FleetCoordinator([worker.url], journal=journal).update_sync(str(worker.root / "none"), "v")
        assert locked.value.code == "journal_locked"
    finally:
        router.journal.release()
        router.journal.close()
    with pytest.raises(InvalidRequest) as needs:
        Router([worker.url], follow_journal=True)
    assert needs.value.code == "journal_required"
