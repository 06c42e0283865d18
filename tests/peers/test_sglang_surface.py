"""SGLang's control surface as its clients read it, on a real worker: ``/health_generate``,
``/get_server_info``, ``/get_load``, ``/abort_request``, numeric strings where SGLang's
server coerces them, ``selector``, and SGLang-shaped refusals of paths and methods.

The shapes follow SGLang's server (``python/sglang/srt/entrypoints/http_server.py``:
``health_generate``, ``get_server_info``, ``get_load``, ``abort_request``) and its request
structs (``python/sglang/srt/managers/io_struct.py``: ``AbortReq``,
``InitWeightsUpdateGroupReqInput``, ``GetLoadReqOutput``); the calls are the ones slime/Miles
make (``slime/rollout/sglang_rollout.py`` ``abort``: ``{"abort_all": true}``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.helpers import TINY
from tests.peers.sglang_worker import SglangWorker, sglang_worker
from weightsync.core import Controller
from weightsync.edge.dialects import sglang_int
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app

__all__ = ["sglang_worker"]


def hold(worker: SglangWorker, ids: list[str]) -> tuple[ThreadPoolExecutor, list[Any]]:
    """Pause (``retract``: requests stay queued) and queue one long completion per id."""
    assert worker.post("/pause_generation", {"mode": "retract"}).json()["success"]
    pool = ThreadPoolExecutor(len(ids))
    futures = [pool.submit(worker.decode, 100, request_id=rid) for rid in ids]
    deadline = time.monotonic() + 60
    while len(worker.engine.in_flight()) < len(ids):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return pool, futures


def finish_reason(future: Any) -> str:
    return str(future.result(timeout=120)["choices"][0]["finish_reason"])


def test_health_generate_is_200_when_a_token_is_generated_and_503_while_paused(
    sglang_worker: SglangWorker,
) -> None:
    r = sglang_worker.get("/health_generate")
    assert r.status_code == 200 and r.json()["success"] is True
    assert sglang_worker.post("/pause_generation", {"mode": "abort"}).json()["success"]
    r = sglang_worker.get("/health_generate")
    assert r.status_code == 503
    assert r.json() == {"success": False, "message": r.json()["message"], "code": "paused"}
    assert sglang_worker.post("/continue_generation", {}).json()["success"]
    assert sglang_worker.get("/health_generate").status_code == 200


def test_health_generate_is_503_while_the_weights_are_torn(sglang_worker: SglangWorker) -> None:
    """A session that wrote holds weights of no version until it ends."""
    path = sglang_worker.other_model("next", seed=4)
    assert sglang_worker.post("/pause_generation", {"mode": "abort"}).json()["success"]
    assert sglang_worker.post("/begin_weight_update", {"selector": "all"}).json()["success"]
    assert sglang_worker.post("/update_weights_from_disk", {"model_path": path}).json()["success"]
    assert sglang_worker.controller.snapshot().torn
    r = sglang_worker.get("/health_generate")
    assert r.status_code == 503 and r.json()["code"] == "weights_torn", r.text
    assert sglang_worker.get("/get_server_info").json()["internal_states"][0]["status"] == "UnHealthy"
    assert sglang_worker.post("/end_weight_update", {}).json()["success"]
    assert sglang_worker.post("/continue_generation", {}).json()["success"]
    assert sglang_worker.get("/health_generate").status_code == 200


def test_get_load_counts_the_held_requests_and_abort_request_ends_them(sglang_worker: SglangWorker) -> None:
    assert sglang_worker.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0}]
    pool, futures = hold(sglang_worker, ["r1", "r2", "r3"])
    with pool:
        assert sglang_worker.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 3}]
        r = sglang_worker.post("/abort_request", {"rid": "r1"})
        assert r.status_code == 200 and r.json()["aborted"] == 1, r.text
        assert finish_reason(futures[0]) == "abort"
        assert sglang_worker.post("/abort_request", {"rid": "not-held"}).json()["aborted"] == 0
        assert sglang_worker.post("/abort_request", {"abort_all": True}).json()["aborted"] == 2
        assert [finish_reason(f) for f in futures[1:]] == ["abort", "abort"]
    assert sglang_worker.get("/get_load").json()[0]["num_reqs"] == 0


@pytest.mark.parametrize(
    ("body", "code"),
    [({}, "missing_field"), ({"rid": 5}, "wrong_type"), ({"abort_all": "yes"}, "wrong_type"),
     ({"rids": ["a"]}, "unknown_field")],
)  # fmt: skip
def test_a_bad_abort_request_is_refused_in_sglangs_shape(
    sglang_worker: SglangWorker, body: Any, code: str
) -> None:
    r = sglang_worker.post("/abort_request", body)
    assert r.status_code == 400 and r.json()["success"] is False and r.json()["code"] == code, r.text


def test_get_server_info_reports_sglangs_server_args_and_no_secret(tmp_path: Path) -> None:
    key = "k" * 32
    with ServerThread(create_app(Controller(ReferenceEngine(TINY)), api_key=key)) as server:
        headers = {"Authorization": f"Bearer {key}"}
        assert requests.get(f"{server.url}/get_server_info", timeout=60).status_code == 401
        r = requests.get(f"{server.url}/get_server_info", headers=headers, timeout=60)
        info = r.json()
        assert r.status_code == 200 and key not in r.text
        assert info["model_path"] == "reference" and info["weight_version"] == "default"
        assert (info["tp_size"], info["dp_size"], info["port"]) == (1, 1, int(server.url.rsplit(":", 1)[1]))
        assert info["internal_states"] == [
            {"status": "Up", "weight_version": "default", "version_declared": False, "paused": False,
             "torn": False, "digest": info["internal_states"][0]["digest"]}
        ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "value"),
    [("29500", 29500), (" 29500 ", 29500), ("+2", 2), ("-1", -1), ("29500x", "29500x"), ("", ""),
     ("0x10", "0x10"), ("٣", "٣"), ("2.0", "2.0"), (True, True), (29500.0, 29500.0), ("1" * 40, "1" * 40)],
)  # fmt: skip
def test_sglang_int_reads_decimal_strings_only(text: Any, value: Any) -> None:
    out = sglang_int(text)
    assert out == value and type(out) is type(value)


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"master_port": "29500x"}, "wrong_type", "master_port"),
        ({"master_port": True}, "wrong_type", "master_port"),
        ({"world_size": "two"}, "wrong_type", "world_size"),
        # numeric strings are integers: the bounds are checked on them
        ({"rank_offset": "3", "world_size": "2"}, "invalid_value", "rank_offset"),
        ({"master_port": "70000"}, "invalid_value", "master_port"),
    ],
)
def test_init_weights_update_group_reads_numeric_strings_as_sglang_does(
    sglang_worker: SglangWorker, fields: dict[str, Any], code: str, field: str
) -> None:
    body = {"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": "1", "world_size": "2",
            "group_name": "g", "backend": "gloo", **fields}  # fmt: skip
    before = sglang_worker.controller.snapshot()
    r = sglang_worker.post("/init_weights_update_group", body)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert r.json()["code"] == code and field in r.json()["message"], r.text
    assert sglang_worker.controller.snapshot() == before


@pytest.mark.parametrize(
    ("selector", "code"), [("draft", "not_supported"), ("both", "invalid_value"), (7, "invalid_value")]
)
def test_a_selector_naming_weights_a_worker_does_not_serve_is_refused(
    sglang_worker: SglangWorker, selector: Any, code: str
) -> None:
    path = sglang_worker.other_model("next", seed=3)
    before = sglang_worker.controller.snapshot()
    for route, body in [
        ("/update_weights_from_disk", {"model_path": path, "selector": selector}),
        ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                              "selector": selector}),
        ("/begin_weight_update", {"selector": selector}),
    ]:  # fmt: skip
        r = sglang_worker.post(route, body)
        assert r.status_code == 400 and r.json()["code"] == code, (route, r.text)
    assert sglang_worker.controller.snapshot() == before
    assert sglang_worker.get("/get_model_info").json()["model_path"] == sglang_worker.model_path


def test_selector_all_and_target_name_the_served_model(sglang_worker: SglangWorker) -> None:
    for selector in ("all", "target"):
        path = sglang_worker.other_model(selector, seed=len(selector))
        r = sglang_worker.post("/update_weights_from_disk", {"model_path": path, "selector": selector})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert sglang_worker.get("/get_model_info").json()["model_path"] == path


def test_unrouted_sglang_paths_and_methods_answer_in_sglangs_shape_and_others_keep_theirs(
    sglang_worker: SglangWorker,
) -> None:
    r = sglang_worker.get("/update_weights_from_disk")
    assert r.status_code == 405 and r.json()["success"] is False and r.json()["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"
    r = sglang_worker.post("/get_model_info", {})
    assert r.status_code == 405 and r.json()["success"] is False
    r = sglang_worker.post("/get_weights_by_name", {"name": "lm_head.weight"})
    assert r.status_code == 404 and r.json() == {"success": False, "message": r.json()["message"],
                                                 "code": "unknown_route"}  # fmt: skip
    # weightsync's own paths, vLLM's and any other path keep weightsync's shape
    for method, path, status in [("GET", "/engine/pause_generation", 405), ("POST", "/engine/nope", 404),
                                 ("GET", "/pause", 405), ("GET", "/no_such_route", 404)]:  # fmt: skip
        r = requests.request(
            method, f"{sglang_worker.url}{path}", json={} if method == "POST" else None, timeout=60
        )
        assert r.status_code == status and r.json()["status"] == "error" and "success" not in r.json(), path
