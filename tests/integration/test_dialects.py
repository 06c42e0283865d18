"""vLLM's RL API and SGLang's RL routes on a real worker (reference engine, real loopback
HTTP), driven with requests built exactly as each framework's client builds them."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.dialect_worker import Served, served
from tests.helpers import hashes, perturbed
from weightsync.trainer import save_checkpoint

__all__ = ["served"]

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
    # vLLM names a query parameter's place as FastAPI does: query.mode
    assert err["type"] == "invalid_value" and err["code"] == 400 and err["param"] == "query.mode"
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


def test_every_dialect_path_is_served_and_mapped_in_dialects_md(served: Served) -> None:
    from weightsync.serve.dialects import DIALECT_PATHS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "dialects.md").read_text()
    for path in sorted(DIALECT_PATHS):
        assert f" {path}" in doc or f"`{path}" in doc or f"|{path}" in doc, f"docs/dialects.md lacks {path}"
        r = requests.request("OPTIONS", f"{served.url}{path}", timeout=30)
        assert r.status_code != 404, path
