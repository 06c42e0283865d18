"""vLLM's RL API and SGLang's RL routes on a real worker (reference engine, real loopback
HTTP), driven with requests built exactly as each framework's client builds them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import requests

from tests.helpers import TINY, hashes, perturbed
from weightsync.core import Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import save_checkpoint
from weightsync.transports.http import ServerThread, create_app

pytestmark = pytest.mark.integration


@attrs.define
class Served:
    url: str
    engine: ReferenceEngine
    controller: Controller
    root: Path

    def post(self, path: str, json: Any = None, **kw: Any) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=json, timeout=60, **kw)

    def get(self, path: str) -> requests.Response:
        return requests.get(f"{self.url}{path}", timeout=60)

    def state(self) -> tuple[Any, ...]:
        snap = self.controller.snapshot()
        return (
            snap.version,
            snap.generation,
            snap.digest,
            snap.commits,
            tuple(sorted(hashes(self.engine).items())),
        )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path])
    controller = Controller(engine)
    with ServerThread(create_app(controller)) as server:
        yield Served(server.url, engine, controller, tmp_path)


# ---------------------------------------------------------------- vLLM


def test_vllm_pause_resume_and_is_paused_answer_in_vllms_shapes(served: Served) -> None:
    assert served.get("/is_paused").json() == {"is_paused": False}
    assert served.post("/pause?mode=keep").json() == {"status": "paused"}
    assert served.get("/is_paused").json() == {"is_paused": True}
    assert served.controller.snapshot().paused
    assert served.post("/resume").json() == {"status": "resumed"}
    assert not served.controller.snapshot().paused


def test_vllm_default_pause_is_abort_with_the_deprecated_cache_clear(served: Served) -> None:
    r = served.post("/pause")
    assert r.status_code == 200 and r.json() == {"status": "paused"}
    assert served.controller.journal[-1].command == "pause"


def test_vllm_error_shape_names_weightsyncs_code_and_changes_nothing(served: Served) -> None:
    before = served.state()
    r = served.post("/pause?mode=sideways")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_value" and err["code"] == 400 and err["param"] == "mode"
    assert served.state() == before


def test_vllm_weight_version_starts_as_default_and_follows_declarations(served: Served) -> None:
    assert served.get("/weight_info").json()["weight_version"] == "default"
    assert served.get("/weight_info").json()["version_declared"] is False
    r = served.post("/update_weight_version", json={"new_version": "step-3"})
    assert r.json()["success"] is True and r.json()["new_version"] == "step-3"
    assert served.get("/weight_info").json()["weight_version"] == "step-3"


def test_vllm_weight_checker_checksums_and_compares(served: Served) -> None:
    sums = served.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert sums == hashes(served.engine)
    same = served.post("/weight_checker", json={"action": "compare", "baseline": sums}).json()
    assert same == {"match": True, "mismatches": []}
    name = next(iter(sums))
    other = served.post("/weight_checker", json={"action": "compare", "baseline": {**sums, name: "0"}}).json()
    assert other == {"match": False, "mismatches": [name]}
    reset = served.post("/weight_checker", json={"action": "reset"})
    assert reset.status_code == 501 and reset.json()["error"]["type"] == "not_supported"


def test_vllm_world_size_and_abort_requests(served: Served) -> None:
    assert served.get("/get_world_size").json() == {"world_size": 1}
    assert served.post("/abort_requests", json={"request_ids": ["nope"]}).json() == {
        "status": "aborted",
        "aborted": 0,
    }


def test_vllm_pickled_ipc_handles_are_refused_before_anything_runs(served: Served) -> None:
    served.post("/pause?mode=wait")
    before = served.state()
    body = {
        "update_info": {
            "names": ["x"],
            "dtype_names": ["float32"],
            "shapes": [[1]],
            "ipc_handles_pickled": "gAR9lC4=",
        }
    }
    r = served.post("/update_weights", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "pickle_refused"
    assert "never unpickles" in r.json()["error"]["message"]
    assert served.state() == before


# ---------------------------------------------------------------- SGLang


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_sglang_pause_each_mode_then_continue(served: Served, mode: str) -> None:
    r = served.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200 and r.json()["success"] is True
    assert served.controller.snapshot().paused
    r = served.post("/continue_generation", json={})
    assert r.status_code == 200 and r.json()["success"] is True
    assert not served.controller.snapshot().paused


def test_sglang_disk_update_with_weight_version_on_a_running_worker(served: Served) -> None:
    new = perturbed(served.engine.model.weights(), seed=3)
    path = save_checkpoint(new, served.root / "step-3")
    r = served.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "step-3"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and "step-3" in body["message"] and body["num_paused_requests"] == 0
    assert served.get("/get_weight_version").json()["weight_version"] == "step-3"
    snap = served.controller.snapshot()
    assert not snap.paused and not snap.torn  # paused for the update, continued after it
    assert served.get("/model_info").json()["weight_version"] == "step-3"


def test_sglang_keep_pause_leaves_the_worker_paused(served: Served) -> None:
    path = save_checkpoint(perturbed(served.engine.model.weights(), seed=4), served.root / "s4")
    r = served.post("/update_weights_from_disk", json={"model_path": str(path), "keep_pause": True})
    assert r.json()["success"] is True
    assert served.controller.snapshot().paused
    assert served.get("/get_weight_version").json()["weight_version"] == "default"


def test_sglang_failed_update_is_success_false_and_changes_nothing(served: Served) -> None:
    before = served.state()
    r = served.post(
        "/update_weights_from_disk", json={"model_path": str(served.root / "missing"), "weight_version": "x"}
    )
    assert r.status_code == 400
    body = r.json()
    assert body["success"] is False and body["message"] and body["code"]
    assert served.state() == before  # still running, same version and weights


def test_sglang_flush_cache_answers_text(served: Served) -> None:
    served.post("/pause_generation", json={"mode": "abort"})
    r = requests.get(f"{served.url}/flush_cache", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text.startswith("Cache flushed")


def test_sglang_serialized_named_tensors_are_refused_as_pickle(served: Served) -> None:
    before = served.state()
    r = served.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["gAR9lC4="]})
    assert r.status_code == 400
    assert r.json()["success"] is False and r.json()["code"] == "pickle_refused"
    assert served.state() == before


def test_sglang_update_weight_version_with_abort_all_requests(served: Served) -> None:
    r = served.post("/update_weight_version", json={"new_version": "v9", "abort_all_requests": True})
    assert r.json() == {"success": True, "message": "Weight version updated to v9", "new_version": "v9"}


def test_a_cross_site_bodiless_post_is_still_refused(served: Served) -> None:
    before = served.state()
    r = served.post("/pause?mode=abort", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    r = requests.post(
        f"{served.url}/pause?mode=abort", data="x", headers={"Content-Type": "text/plain"}, timeout=30
    )
    assert r.status_code == 415
    assert served.state() == before


# ---------------------------------------------------------------- fuzz

VLLM_POSTS = [
    "/pause", "/resume", "/abort_requests", "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
    "/update_weights", "/weight_checker", "/update_weight_version",
]  # fmt: skip
SGLANG_POSTS = [
    "/update_weights_from_disk", "/update_weights_from_distributed", "/update_weights_from_tensor",
    "/init_weights_update_group", "/destroy_weights_update_group", "/pause_generation",
    "/continue_generation", "/update_weight_version",
]  # fmt: skip
BAD_BODIES: list[Any] = [
    [],
    "text",
    17,
    {"no_such_field": 1},
    {"mode": 3},
    {"init_info": "x"},
    {"update_info": [1]},
    {"update_info": {"names": "x"}},
    {"model_path": 5},
    {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g", "flush_cache": "yes"},
    {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2},
    {"action": "sum"},
    {"new_version": {"a": float("inf")}} if False else {"new_version": None, "abort_all_requests": "no"},
]


@pytest.mark.parametrize("path", VLLM_POSTS + SGLANG_POSTS)
def test_every_dialect_route_refuses_bad_bodies_with_a_code_and_changes_nothing(
    served: Served, path: str
) -> None:
    before = served.state()
    for body in BAD_BODIES:
        r = served.post(path, json=body)
        if r.status_code == 200:  # a body this route has no fields for but accepts is fine only if empty-ish
            assert body in ({},), (path, body, r.text)
            continue
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
        reply = r.json()
        code = reply["error"]["type"] if "error" in reply else reply["code"]
        assert isinstance(code, str) and code, (path, body, reply)
        assert served.state() == before, (path, body)
    broken = requests.post(
        f"{served.url}{path}", data=b"{not json", headers={"Content-Type": "application/json"}, timeout=30
    )
    assert 400 <= broken.status_code < 500
    assert served.state() == before


def test_every_dialect_path_is_served_and_mapped_in_dialects_md(served: Served) -> None:
    from weightsync.transports.http.dialects import DIALECT_PATHS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "dialects.md").read_text()
    for path in sorted(DIALECT_PATHS):
        assert f" {path}" in doc or f"`{path}" in doc or f"|{path}" in doc, f"docs/dialects.md lacks {path}"
        r = requests.request("OPTIONS", f"{served.url}{path}", timeout=30)
        assert r.status_code != 404, path
