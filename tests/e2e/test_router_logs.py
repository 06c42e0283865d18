"""A real ``weightsync router`` says what it does at its default level: through a rolling
update (``max_unavailable=1``) and a worker killed after it, its ``--log-format json`` lines
name every batch drained and returned, the transaction's steps, every worker admitted back
into routing, and the killed worker's fencing.

Failed on the old code: the router logged nothing (its level was warning, and it had no
events to log)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import TINY, RouterProcess, perturbed, served_workers
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer.checkpoint import save_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_routers_log_through_a_rolling_update_and_a_kill(tmp_path: Path) -> None:
    weights = dict(ReferenceEngine(TINY).model.weights())
    old = save_checkpoint(weights, tmp_path / "step-0")
    new = save_checkpoint(perturbed(weights, seed=1), tmp_path / "step-1")
    with served_workers(3, "--initial-version", '"v0"') as workers:
        urls = [w.url for w in workers]
        router = RouterProcess(
            urls, "--poll-interval-s", "0.2", "--journal", str(tmp_path / "fleet.db"),
            "--initial-source", str(old), "--log-format", "json",
        ).wait_ready()  # fmt: skip
        try:
            with httpx.Client(base_url=router.url, timeout=120) as http:
                r = http.post(
                    "/fleet/update_weights_from_disk",
                    json={"model_path": str(new), "weight_version": "v1", "max_unavailable": 1},
                )
                assert r.status_code == 200 and r.json()["committed"], r.text
                workers[2].proc.send_signal(signal.SIGKILL)
                workers[2].proc.wait(timeout=30)
                deadline = time.monotonic() + 30
                while True:
                    states = {w["url"]: w["state"] for w in http.get("/fleet/status").json()["workers"]}
                    if states[urls[2]] == "unreachable" or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            router.proc.send_signal(signal.SIGINT)
            router.proc.wait(timeout=30)
            err = router.log()
        finally:
            router.stop()
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    mine = [line for line in lines if line["logger"] == "weightsync.router"]
    assert all(line["level"] == "INFO" for line in mine), mine
    by = {}
    for line in mine:
        by.setdefault(line["event"], []).append(line)
    assert [(b["batch"], b["batches"]) for b in by["batch_draining"]] == [(1, 3), (2, 3), (3, 3)]
    assert [len(b["workers"]) for b in by["batch_returned"]] == [1, 1, 1]
    assert {t["phase"] for t in by["transaction"]} >= {"preparing", "committed"}, by["transaction"]
    assert {a["worker"] for a in by["admitted"]} == set(urls)
    assert any(f["worker"] == urls[2] and f["why"] in ("unreachable", "lost") for f in by["fenced"]), by
    done = by["update_done"][-1]
    assert done["committed"] is True and done["version"] == "v1" and done["next_step"]
