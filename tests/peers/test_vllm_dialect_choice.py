"""``serve --dialect`` and ``--auto-pause-updates`` on real workers: which shape answers a path
vLLM and SGLang both serve, vLLM's server routes a trainer reads (``/server_info``,
``/reset_prefix_cache``, ``/v1/models``), and vLLM's own ``HTTPVLLMWeightSyncClient``
(``vllm/distributed/weight_transfer/clients.py``: ``start_weight_update`` posts no body,
``finish_weight_update`` posts ``{"weight_version"}`` or nothing) on a serving worker."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.helpers import WorkerProcess
from tests.peers.vllm_calls import is_paused, make_vllm_worker, weight_info_response
from weightsync.engines.reference import ModelConfig

__all__ = ["make_vllm_worker"]

Make = Callable[..., str]


def version(url: str, body: Any) -> requests.Response:
    return requests.post(f"{url}/update_weight_version", json=body, timeout=30)


def state(url: str) -> dict[str, Any]:
    return dict(requests.post(f"{url}/engine/get_weight_version", json={}, timeout=30).json())


# ---------------------------------------------------------------- /update_weight_version


def test_the_default_answers_update_weight_version_in_the_requests_own_shape(make_vllm_worker: Make) -> None:
    url = make_vllm_worker()
    assert version(url, {"new_version": "a"}).json() == {"success": True, "new_version": "a"}
    sglang = version(url, {"new_version": "b", "abort_all_requests": False})  # a field only SGLang has
    assert sglang.json() == {"success": True, "message": "Weight version updated to b", "new_version": "b"}
    refused = version(url, {})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "body.new_version"
    refused = version(url, {"abort_all_requests": False})
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert weight_info_response(url).json()["weight_version"] == "b"


def test_dialect_sglang_answers_update_weight_version_in_sglangs_shape(make_vllm_worker: Make) -> None:
    url = make_vllm_worker(dialect="sglang")
    ok = version(url, {"new_version": "a"})
    assert ok.json() == {"success": True, "message": "Weight version updated to a", "new_version": "a"}
    refused = version(url, {})
    assert refused.status_code == 400 and refused.json()["success"] is False and "error" not in refused.json()


def test_dialect_vllm_refuses_sglangs_own_field_in_vllms_shape(make_vllm_worker: Make) -> None:
    url = make_vllm_worker(dialect="vllm")
    before = state(url)
    refused = version(url, {"new_version": "a", "abort_all_requests": True})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "body.abort_all_requests"
    assert state(url) == before


# ---------------------------------------------------------------- vLLM's server routes


def test_server_info_is_vllms_when_the_request_names_config_format(make_vllm_worker: Make) -> None:
    url = make_vllm_worker()
    info = requests.get(f"{url}/server_info", params={"config_format": "json"}, timeout=30).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "nccl"}
    assert "vllm_config" not in requests.get(f"{url}/server_info", timeout=30).json()  # SGLang's reply
    only_vllm = make_vllm_worker(dialect="vllm")
    text = requests.get(f"{only_vllm}/server_info", timeout=30).json()["vllm_config"]
    assert isinstance(text, str) and "weight_transfer_config={'backend': 'nccl'}" in text
    bad = requests.get(f"{only_vllm}/server_info", params={"config_format": "yaml"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.config_format"


def test_weight_info_has_weightsyncs_fields_unless_the_dialect_is_vllm(make_vllm_worker: Make) -> None:
    both = weight_info_response(make_vllm_worker()).json()
    assert both["weight_version"] == "default" and both["version_declared"] is False and both["digest"]
    assert weight_info_response(make_vllm_worker(dialect="vllm")).json() == {"weight_version": "default"}


def test_reset_prefix_cache_answers_vllms_success_and_refuses_a_reset_under_running_requests(
    make_vllm_worker: Make,
) -> None:
    url = make_vllm_worker()
    r = requests.post(f"{url}/reset_prefix_cache", timeout=30)  # no body, no Content-Type, as TRL posts
    assert r.status_code == 200 and r.json() == {"success": True}
    before = state(url)
    r = requests.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=30)
    assert r.status_code == 501 and r.json()["error"]["param"] == "query.reset_running_requests"
    assert state(url) == before


def test_a_reset_under_running_requests_is_vllms_success_false(make_worker: Callable[..., Any]) -> None:
    """vLLM answers a reset that did not happen (blocks held by running requests) with 200
    ``{"success": false}``, for the caller to retry; the request runs on."""
    worker = make_worker(ModelConfig())  # the default size: a request stays in flight a while
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            requests.post, f"{worker.url}/v1/completions", json={"prompt": list(range(40)), "max_tokens": 200},
            timeout=120,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not worker.engine.scheduler.active:
            assert time.monotonic() < deadline and not running.done(), "the request did not start"
            time.sleep(0.01)
        r = requests.post(f"{worker.url}/reset_prefix_cache", timeout=30)
        assert r.status_code == 200
        assert r.json()["success"] is False and r.json()["code"] == "cache_in_use"
        aborted = requests.post(f"{worker.url}/abort_requests", json={}, timeout=30).json()
        assert aborted["aborted"] == 1
        assert running.result(timeout=60).json()["choices"][0]["finish_reason"] == "abort"


def test_v1_models_lists_the_served_model(make_vllm_worker: Make) -> None:
    models = requests.get(f"{make_vllm_worker()}/v1/models", timeout=30).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["reference"]
    assert models["data"][0]["object"] == "model"


# ---------------------------------------------------------------- --auto-pause-updates


def test_vllms_own_client_updates_a_serving_worker_that_pauses_for_it(make_vllm_worker: Make) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = make_vllm_worker(auto_pause_updates=True)
    client = HTTPVLLMWeightSyncClient(url, timeout=60)
    client.start_weight_update()
    assert is_paused(url) and state(url)["session_open"]
    client.finish_weight_update("v1")
    assert not is_paused(url) and weight_info_response(url).json()["weight_version"] == "v1"
    refusing = HTTPVLLMWeightSyncClient(make_vllm_worker(), timeout=60)
    with pytest.raises(requests.HTTPError, match="409"):
        refusing.start_weight_update()


def test_an_explicit_pause_during_an_auto_paused_update_keeps_the_worker_paused(
    make_vllm_worker: Make,
) -> None:
    url = make_vllm_worker(auto_pause_updates=True)
    assert requests.post(f"{url}/start_weight_update", timeout=30).status_code == 200
    assert requests.post(f"{url}/pause", params={"mode": "keep"}, timeout=30).status_code == 200
    assert requests.post(f"{url}/finish_weight_update", timeout=30).status_code == 200
    assert is_paused(url)  # the caller's pause is the caller's to end


def test_the_next_finish_resumes_a_worker_an_abandoned_update_left_paused(make_vllm_worker: Make) -> None:
    url = make_vllm_worker(auto_pause_updates=True, session_timeout_s=0.3)
    assert requests.post(f"{url}/start_weight_update", timeout=30).status_code == 200
    deadline = time.monotonic() + 30
    while state(url)["session_open"]:  # abandoned by its deadline
        assert time.monotonic() < deadline, "the session was not abandoned"
        time.sleep(0.05)
    assert is_paused(url)  # an abandoned session leaves the worker paused
    assert requests.post(f"{url}/start_weight_update", timeout=30).status_code == 200
    assert requests.post(f"{url}/finish_weight_update", timeout=30).status_code == 200
    assert not is_paused(url)


# ---------------------------------------------------------------- the command line


def test_serve_takes_the_dialect_and_auto_pause_flags() -> None:
    worker = WorkerProcess("--dialect", "vllm", "--auto-pause-updates").wait_ready()
    try:
        assert weight_info_response(worker.url).json() == {"weight_version": "default"}
        assert requests.post(f"{worker.url}/start_weight_update", json={}, timeout=30).status_code == 200
        assert requests.post(f"{worker.url}/finish_weight_update", json={}, timeout=30).status_code == 200
        assert not is_paused(worker.url)
    finally:
        worker.stop()
    refused = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "serve", "--dialect", "dynamo"],
        capture_output=True,
        timeout=120,
    )
    assert refused.returncode == 2 and b"--dialect" in refused.stderr
