"""Memory release and sleep (DESIGN.md §14) over real loopback HTTP, on the reference engine,
which really frees its tensors: weightsync's own routes, SGLang's and vLLM's."""

from __future__ import annotations

from typing import Any

import httpx

from tests.helpers import greedy
from tests.integration.test_digest import checkpoint, manifest_digest, ok, post, status
from tests.workers import Worker


def get(worker: Worker, path: str) -> dict[str, Any]:
    reply = httpx.get(f"{worker.url}{path}", timeout=30)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def completion(worker: Worker) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)


def test_level_two_sleep_holds_no_weights_until_an_update_then_wake_serves_the_new_digest(
    worker: Worker,
) -> None:
    ok(worker, "set_weight_version", {"weight_version": "v1"})
    reply = httpx.post(f"{worker.url}/sleep?level=2", timeout=30)
    assert reply.json() == {"status": "sleeping", "level": 2}
    assert all(p.untyped_storage().nbytes() == 0 for p in worker.engine.model.weights().values())
    st = status(worker)
    assert st["weights_released"] is True and st["weights"] == "discarded" and st["kv_cache"] == "released"
    assert st["digest"] is None and st["version"] == "v1" and st["version_current"] is False
    assert get(worker, "/is_sleeping") == {"is_sleeping": True}
    refused = completion(worker)
    assert refused.status_code == 409 and "weights_released" in refused.text
    resumed = post(worker, "resume_generation")
    assert resumed.status_code == 409 and resumed.json()["code"] == "weights_released"
    # a wake without an update gives the weights memory but no version: still asleep
    woke = httpx.post(f"{worker.url}/wake_up?tags=weights", timeout=30).json()
    assert woke["status"] == "sleeping" and status(worker)["weights_released"] is True
    ckpt = checkpoint(worker, "new")
    ok(worker, "update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "v2"})
    woke = httpx.post(f"{worker.url}/wake_up", timeout=30).json()
    assert woke == {"status": "awake", "tags": None}
    st = status(worker)
    assert not st["paused"] and not st["weights_released"] and st["digest"] == manifest_digest(ckpt)
    assert st["version"] == "v2" and st["version_current"] is True
    assert completion(worker).status_code == 200


def test_level_one_sleep_then_wake_keeps_the_digest_and_the_greedy_output(worker: Worker) -> None:
    before, digest, ckpt = greedy(worker.url), status(worker)["digest"], checkpoint(worker, "c")
    assert httpx.post(f"{worker.url}/sleep?level=1&mode=wait", timeout=30).status_code == 200
    st = status(worker)
    assert st["weights"] == "offloaded" and st["digest"] == digest and st["paused"]
    refused = post(worker, "update_weights_from_disk", {"model_path": str(ckpt)})
    assert refused.status_code == 409 and refused.json()["code"] == "weights_offloaded"
    assert httpx.post(f"{worker.url}/wake_up", timeout=30).json()["status"] == "awake"
    assert status(worker)["digest"] == digest and greedy(worker.url) == before
    assert ok(worker, "verify_weights")["match"] is True


def cached(worker: Worker, prompt: str) -> bool:
    return worker.engine.cache.cached(worker.engine.stamps.epoch, list(prompt.encode()))


def test_a_released_kv_cache_comes_back_empty(worker: Worker) -> None:
    prompt = "a prompt long enough to fill a cached prefix block, twice over"
    httpx.post(f"{worker.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
    assert cached(worker, prompt)
    ok(worker, "pause_generation")
    ok(worker, "release_memory", {"weights": "keep", "kv_cache": True})
    refused = post(worker, "resume_generation")
    assert refused.status_code == 409 and refused.json()["code"] == "kv_released"
    reply = ok(worker, "resume_memory", {"weights": False})
    assert reply["kv_cache"] == "resident" and reply["weights"] == "resident"
    assert not cached(worker, prompt)
    ok(worker, "resume_generation")


def test_sglang_tags_release_and_resume_as_slime_does(worker: Worker) -> None:
    url, digest, ckpt = worker.url, status(worker)["digest"], checkpoint(worker, "slime")
    released = httpx.post(f"{url}/release_memory_occupation", json={"tags": None}, timeout=30).json()
    assert released["success"] is True and released["weights_released"] is True
    assert status(worker)["paused"]  # a serving worker is paused for its release
    resumed = httpx.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]}, timeout=30).json()
    assert resumed["weights"] == "discarded" and resumed["kv_cache"] == "released"
    httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(ckpt)}, timeout=30)
    resumed = httpx.post(f"{url}/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30).json()
    st = status(worker)
    assert resumed["success"] and not st["paused"] and st["digest"] == manifest_digest(ckpt) != digest
    bad = httpx.post(f"{url}/release_memory_occupation", json={"tags": ["gpu"]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_value"


def test_release_is_refused_while_running_and_in_a_session(worker: Worker) -> None:
    refused = post(worker, "release_memory", {"weights": "discard"})
    assert refused.status_code == 409 and refused.json()["code"] == "not_paused"
    ok(worker, "pause_generation")
    ok(worker, "begin_weight_update")
    refused = post(worker, "release_memory", {})
    assert refused.status_code == 409 and refused.json()["code"] == "session_open"
    assert status(worker)["weights"] == "resident"
