"""SGLang's own checks of ``/update_weights_from_disk``, re-run against a weightsync worker.

Followed one for one: ``test/srt/rl/test_update_weights_from_disk.py`` in sgl-project/sglang,
its server-mode classes (``run_decode`` is a greedy ``/v1/completions`` here: ``/generate`` is
not what these tests are about):

- ``TestServerUpdateWeightsFromDisk.test_update_weights`` and
  ``test_update_weights_unexist_model``;
- ``TestServerUpdateWeightsFromDiskAbortAllRequests.test_update_weights_abort_all_requests``;
- ``TestServerUpdateWeightsFromDiskOnline.test_update_weights_online``.

SGLang's two request tests start 32 long requests and sleep 2 s "to ensure the decode has
been started"; here the test waits until the engine holds its requests instead of sleeping.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.peers.sglang_worker import SglangWorker, sglang_worker

__all__ = ["sglang_worker"]


def model_path(worker: SglangWorker) -> str:
    """``get_model_info`` of SGLang's test."""
    r = worker.get("/get_model_info")
    assert r.status_code == 200, r.text
    return str(r.json()["model_path"])


def update(worker: SglangWorker, path: str, **fields: object) -> dict[str, object]:
    """``run_update_weights`` of SGLang's test: the reply's JSON, whatever its status."""
    return dict(worker.post("/update_weights_from_disk", {"model_path": path, **fields}).json())


def wait_held(worker: SglangWorker, n: int) -> None:
    deadline = time.monotonic() + 60
    while len(worker.engine.in_flight()) < n:
        assert time.monotonic() < deadline, "the requests never reached the engine"
        time.sleep(0.01)


def test_update_weights_follows_model_path_and_reverts_to_the_same_outputs(
    sglang_worker: SglangWorker,
) -> None:
    origin_model_path = model_path(sglang_worker)
    assert origin_model_path == sglang_worker.model_path  # a real path: the reload idiom works
    origin = sglang_worker.tokens()

    new_model_path = sglang_worker.other_model("base", seed=7)
    ret = update(sglang_worker, new_model_path)
    assert ret["success"] is True, ret
    assert model_path(sglang_worker) == new_model_path != origin_model_path
    assert sglang_worker.tokens() != origin

    ret = update(sglang_worker, origin_model_path)
    assert ret["success"] is True, ret
    assert model_path(sglang_worker) == origin_model_path
    assert sglang_worker.tokens() == origin


def test_model_path_names_the_checkpoint_only_while_its_weights_are_held(sglang_worker: SglangWorker) -> None:
    """SGLang keeps reporting its launch path after other weights arrive; a worker reports
    what it holds: once a load by another route (Dynamo's ``/engine/update_weights_from_disk``)
    replaced the checkpoint's weights, ``model_path`` is the engine's name in both info
    replies, so "reload the current ``model_path``" cannot silently bring back old weights."""
    launched = model_path(sglang_worker)
    other = sglang_worker.other_model("other", seed=3)
    steps = [
        ("pause_generation", {"mode": "wait"}),
        ("update_weights_from_disk", {"model_path": other}),
        ("resume_generation", {}),
    ]
    for route, body in steps:
        r = sglang_worker.post(f"/engine/{route}", body)
        assert r.status_code == 200, r.text
    name = sglang_worker.engine.name
    assert model_path(sglang_worker) == name != launched
    info = sglang_worker.get("/get_server_info")
    assert info.status_code == 200 and info.json()["model_path"] == name, info.text

    ret = update(sglang_worker, launched)  # SGLang's reload of its launch path holds it again
    assert ret["success"] is True, ret
    assert model_path(sglang_worker) == launched
    assert sglang_worker.get("/get_server_info").json()["model_path"] == launched


def test_update_weights_unexist_model_is_success_false_and_changes_nothing(
    sglang_worker: SglangWorker,
) -> None:
    origin_model_path = model_path(sglang_worker)
    origin = sglang_worker.tokens()
    ret = update(sglang_worker, str(Path(origin_model_path).parent / "launchwrong"))
    assert ret["success"] is False and ret["message"], ret
    assert model_path(sglang_worker) == origin_model_path
    assert sglang_worker.tokens() == origin


def test_update_weights_abort_all_requests_ends_every_request_with_abort(sglang_worker: SglangWorker) -> None:
    origin_model_path = model_path(sglang_worker)
    num_requests = 8
    # The requests are queued behind a pause so that all of them are still in the engine when the
    # update arrives (SGLang's test sleeps instead); the update aborts them, as it does running ones.
    assert sglang_worker.post("/pause_generation", {"mode": "retract"}).json()["success"]
    with ThreadPoolExecutor(num_requests) as pool:
        futures = [pool.submit(sglang_worker.decode, 200) for _ in range(num_requests)]
        wait_held(sglang_worker, num_requests)
        new_model_path = sglang_worker.other_model("base", seed=7)
        ret = update(sglang_worker, new_model_path, abort_all_requests=True)
        assert ret["success"] is True, ret
        reasons = [f.result(timeout=120)["choices"][0]["finish_reason"] for f in futures]
    assert reasons == ["abort"] * num_requests
    assert model_path(sglang_worker) == new_model_path != origin_model_path
    assert sglang_worker.post("/continue_generation", {}).json()["success"]


def test_update_weights_online_does_not_pause_or_abort_running_requests(sglang_worker: SglangWorker) -> None:
    origin_model_path = model_path(sglang_worker)
    before = len(sglang_worker.controller.journal)
    num_requests = 8
    with ThreadPoolExecutor(num_requests) as pool:
        futures = [pool.submit(sglang_worker.decode, 200) for _ in range(num_requests)]
        wait_held(sglang_worker, 1)
        new_model_path = sglang_worker.other_model("base", seed=7)
        ret = update(sglang_worker, new_model_path, online=True)
        assert ret["success"] is True, ret
        reasons = [f.result(timeout=120)["choices"][0]["finish_reason"] for f in futures]
    assert "abort" not in reasons
    commands = [entry.command for entry in list(sglang_worker.controller.journal)[before:]]
    assert commands and "pause" not in commands and "resume" not in commands, commands
    assert model_path(sglang_worker) == new_model_path != origin_model_path
