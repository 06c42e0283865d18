"""vLLM's and SGLang's fleet-wide routes posted to a real ``weightsync router`` in front of two
real ``weightsync serve`` workers: they run as fleet operations (a transaction for an update
and a relabel, every worker for a pause or a resume), in each dialect's shapes; the routes
that stream into one worker's group are refused; bad input changes nothing.

One fleet serves the module; each test leaves it routable for the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests

from tests.helpers import TINY, RouterProcess, WorkerProcess, perturbed
from weightsync.core.held import weights_digest
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer.checkpoint import save_checkpoint
from weightsync.transports.hashing import tensor_hashes

pytestmark = pytest.mark.slow


class Fleet:
    def __init__(self, tmp: Path) -> None:
        weights = dict(ReferenceEngine(TINY).model.weights())
        self.weights = [weights, perturbed(weights, seed=1), perturbed(weights, seed=2)]
        self.ckpts = [save_checkpoint(w, tmp / f"step-{i}") for i, w in enumerate(self.weights)]
        self.workers = [WorkerProcess("--initial-version", '"v0"') for _ in range(2)]
        for w in self.workers:
            w.wait_ready()
        self.urls = [w.url for w in self.workers]
        self.router = RouterProcess(
            self.urls, "--poll-interval-s", "0.2", "--journal", str(tmp / "fleet.db"),
            "--initial-source", str(self.ckpts[0]),
        ).wait_ready()  # fmt: skip
        self.url = self.router.url

    def status(self) -> dict[str, Any]:
        return dict(requests.get(f"{self.url}/fleet/status", timeout=30).json())

    def worker_states(self) -> list[dict[str, Any]]:
        return [
            requests.post(f"{u}/engine/get_weight_version", json={}, timeout=30).json() for u in self.urls
        ]

    def wait_for(self, what: Callable[[dict[str, Any]], bool], timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if what(status):
                return status
            assert time.monotonic() < deadline, f"timed out; last status: {status}"
            time.sleep(0.05)

    def routable(self) -> dict[str, Any]:
        return self.wait_for(lambda s: all(w["routable"] for w in s["workers"]))

    def digest(self, index: int) -> str:
        return weights_digest(tensor_hashes(self.weights[index].items()))

    def close(self) -> None:
        self.router.stop()
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("router-dialects"))
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def routable(fleet: Fleet) -> Fleet:
    fleet.routable()
    return fleet


def test_sglangs_disk_update_through_the_router_is_one_rolling_fleet_transaction(routable: Fleet) -> None:
    fleet = routable
    before = fleet.status()["epoch"]
    r = requests.post(
        f"{fleet.url}/update_weights_from_disk",
        json={"model_path": str(fleet.ckpts[1]), "weight_version": "sg-1", "flush_cache": True,
              "max_unavailable": 1},
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["success"] is True and reply["weight_version"] == "sg-1"
    assert reply["weight_epoch"] > (before or 0) and reply["digest"] == fleet.digest(1)
    assert reply["transaction"]["phase"] == "committed"
    for state in fleet.worker_states():
        assert (state["version"], state["epoch"], state["digest"]) == (
            "sg-1",
            reply["weight_epoch"],
            fleet.digest(1),
        )
        assert not state["paused"]
    got = requests.get(f"{fleet.url}/get_weight_version", timeout=30).json()
    assert got == {"weight_version": "sg-1", "version_declared": True, "weight_epoch": reply["weight_epoch"],
                   "digest": fleet.digest(1)}  # fmt: skip
    fleet.routable()
    done = requests.post(f"{fleet.url}/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=60)
    assert done.status_code == 200 and done.json()["weight_version"] == "sg-1"


def test_a_refused_sglang_update_through_the_router_is_success_false_and_changes_nothing(
    routable: Fleet,
) -> None:
    fleet = routable
    before = fleet.status()
    workers = fleet.worker_states()
    for body, code in (
        ({"model_path": str(fleet.ckpts[0].parent / "missing"), "weight_version": "x"}, "prepare_refused"),
        ({"model_path": str(fleet.ckpts[2]), "keep_pause": True}, "not_supported"),
        ({"model_path": str(fleet.ckpts[2]), "load_format": "gguf"}, "not_supported"),
        ({"model_path": 7}, "wrong_type"),
        ({"model_path": str(fleet.ckpts[2]), "serialized_named_tensors": []}, "unknown_field"),
    ):
        r = requests.post(f"{fleet.url}/update_weights_from_disk", json=body, timeout=120)
        assert r.status_code == 400, r.text
        assert r.json()["success"] is False and r.json()["code"] == code and r.json()["message"]
    after = fleet.routable()
    assert (after["epoch"], after["version"]) == (before["epoch"], before["version"])
    assert fleet.worker_states() == workers


def test_vllms_pause_resume_and_is_paused_through_the_router_reach_every_worker(routable: Fleet) -> None:
    fleet = routable
    # As vLLM's trainers post it: no body, no Content-Type.
    r = requests.post(f"{fleet.url}/pause?mode=wait", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "paused" and all(w["ok"] for w in r.json()["workers"])
    assert all(s["paused"] for s in fleet.worker_states())
    paused = requests.get(f"{fleet.url}/is_paused", timeout=30).json()
    assert paused["is_paused"] is True and sorted(paused["paused_workers"]) == sorted(fleet.urls)
    refused = requests.post(
        f"{fleet.url}/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=60
    )
    assert refused.status_code == 503
    r = requests.post(f"{fleet.url}/resume", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "resumed", r.text
    assert not any(s["paused"] for s in fleet.worker_states())
    assert requests.get(f"{fleet.url}/is_paused", timeout=30).json()["is_paused"] is False
    fleet.routable()


def test_sglangs_pause_and_continue_through_the_router_reach_every_worker(routable: Fleet) -> None:
    fleet = routable
    for mode in ("abort", "retract", "in_place"):
        r = requests.post(f"{fleet.url}/pause_generation", json={"mode": mode}, timeout=60)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert all(s["paused"] for s in fleet.worker_states())
        r = requests.post(f"{fleet.url}/continue_generation", json={}, timeout=60)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert not any(s["paused"] for s in fleet.worker_states())
    fleet.routable()
    flushed = requests.post(f"{fleet.url}/flush_cache", timeout=60)
    assert flushed.status_code == 200 and flushed.text == "Cache flushed.\n"


def test_update_weight_version_through_the_router_relabels_the_fleet_under_a_new_epoch(
    routable: Fleet,
) -> None:
    fleet = routable
    before = fleet.status()
    r = requests.post(f"{fleet.url}/update_weight_version", json={"new_version": "relabelled"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["new_version"] == "relabelled"
    assert r.json()["weight_epoch"] > before["epoch"]
    info = requests.get(f"{fleet.url}/weight_info", timeout=30).json()
    assert info["weight_version"] == "relabelled" and info["weight_epoch"] == r.json()["weight_epoch"]
    assert info["digest"] == before["workers"][0]["digest"]  # the same weights, attested again
    assert {(s["version"], s["epoch"]) for s in fleet.worker_states()} == {
        ("relabelled", info["weight_epoch"])
    }
    fleet.routable()


def test_per_worker_dialect_routes_are_refused_by_the_router_and_change_nothing(routable: Fleet) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    fleet = routable
    before, workers = fleet.status(), fleet.worker_states()
    with pytest.raises(requests.HTTPError) as err:
        HTTPVLLMWeightSyncClient(fleet.url, timeout=30).start_weight_update()
    assert err.value.response.status_code == 501
    assert err.value.response.json()["error"]["type"] == "not_supported"
    for path in ("/init_weight_transfer_engine", "/update_weights", "/finish_weight_update"):
        r = requests.post(f"{fleet.url}{path}", json={}, timeout=30)
        assert r.status_code == 501 and r.json()["error"]["code"] == 501, r.text
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/begin_weight_update"):
        r = requests.post(f"{fleet.url}{path}", json={}, timeout=30)
        assert r.status_code == 400 and r.json() == {"success": False, "code": "not_supported",
                                                     "message": r.json()["message"]}  # fmt: skip
    # Bad input on the fleet-wide routes: a 4xx with a code.
    for method, path, body, status, code in (
        ("POST", "/pause?mode=sideways", None, 400, "invalid_value"),
        ("POST", "/pause?mode=wait&mode=abort", None, 400, "invalid_value"),
        ("POST", "/pause?bogus=1", None, 400, "unknown_field"),
        ("POST", "/pause?clear_cache=perhaps", None, 400, "wrong_type"),
        ("POST", "/resume", {"extra": 1}, 400, "unknown_field"),
    ):
        r = requests.request(method, f"{fleet.url}{path}", json=body, timeout=30)
        assert r.status_code == status and r.json()["error"]["type"] == code, r.text
    for path, body, code in (
        ("/pause_generation", {"mode": "sideways"}, "invalid_value"),
        ("/update_weight_version", {}, "missing_field"),
        ("/update_weight_version", {"new_version": "x", "abort_all_requests": True}, "not_supported"),
        ("/continue_generation", {"torch_empty_cache": "yes"}, "wrong_type"),
    ):
        r = requests.post(f"{fleet.url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["success"] is False and r.json()["code"] == code, r.text
    bad = requests.post(f"{fleet.url}/pause_generation", data=b"{", headers={"content-type": "application/json"},
                        timeout=30)  # fmt: skip
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_json"
    cross = httpx.post(f"{fleet.url}/pause", headers={"origin": "http://evil.example"}, timeout=30)
    assert cross.status_code == 403
    after = fleet.routable()
    assert (after["epoch"], after["version"]) == (before["epoch"], before["version"])
    assert fleet.worker_states() == workers
