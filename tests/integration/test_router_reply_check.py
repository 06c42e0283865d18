"""The router checks the label a worker's completion names before relaying a byte: a real
``weightsync serve`` worker reloaded behind the router's back between two polls (the poll
interval is a minute, so no poll sees it) is fenced by the first reply that names its new
weights, and a request pinned to the committed version is answered from the other worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import TINY, RouterProcess, perturbed, served_workers
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer.checkpoint import save_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[RouterProcess, list[str], Path]]:
    ckpt = save_checkpoint(perturbed(dict(ReferenceEngine(TINY).model.weights()), seed=7), tmp_path / "rogue")
    with served_workers(2, "--initial-version", '"t1"') as workers:
        urls = [w.url for w in workers]
        proc = RouterProcess(urls, "--poll-interval-s", "60", "--journal", str(tmp_path / "fleet.db"))
        try:
            yield proc.wait_ready(), urls, ckpt
        finally:
            proc.stop()


def test_a_worker_reloaded_between_polls_never_serves_a_request_pinned_to_the_committed_version(
    router: tuple[RouterProcess, list[str], Path],
) -> None:
    proc, urls, ckpt = router
    with httpx.Client(base_url=proc.url, timeout=60) as http:
        status = http.get("/fleet/status").json()
        assert [w["state"] for w in status["workers"]] == ["routable", "routable"], status
        reload = httpx.post(
            f"{urls[0]}/engine/update_weights_from_disk",
            json={"model_path": str(ckpt), "weight_version": "rogue", "allow_unpaused": True,
                  "reset_prefix_cache": False},
            timeout=60,
        )  # fmt: skip
        assert reload.status_code == 200, reload.text
        served = []
        for _ in range(6):
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "weight_version": "t1"})
            assert r.status_code == 200, r.text
            served.append((r.json()["weight_version"], r.json()["worker"]))
        assert {v for v, _ in served} == {"t1"}
        assert {w for _, w in served} == {urls[1]}
        workers = {w["url"]: w for w in http.get("/fleet/status").json()["workers"]}
        assert (workers[urls[0]]["state"], workers[urls[0]]["why"]) == ("fenced", "reply_mismatch")
        assert workers[urls[1]]["state"] == "routable"
