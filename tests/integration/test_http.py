"""The HTTP admin surface on real loopback servers over the reference engine."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import hashes, perturbed
from tests.workers import Worker
from weightsync.core import errors
from weightsync.core.held import weights_digest
from weightsync.engines.reference import ModelConfig
from weightsync.trainer import WorkerClient, save_checkpoint

PACED = ModelConfig()  # the default size: ~100 tokens/s per request here, so requests stay in flight


JSON = {"content-type": "application/json"}


def post(worker: Worker, route: str, content: bytes | None = None, **kwargs: Any) -> httpx.Response:
    """A raw POST, declared as JSON (the only type the server takes) unless ``headers`` say otherwise."""
    headers = {**JSON, **kwargs.pop("headers", {})}
    return httpx.post(f"{worker.url}/engine/{route}", content=content, timeout=30, headers=headers, **kwargs)


def checkpoint(worker: Worker, name: str, seed: int = 1) -> Path:
    return save_checkpoint(perturbed(worker.engine.model.weights(), seed=seed), worker.root / name)


def hashes_digest(worker: Worker) -> str:
    return weights_digest(hashes(worker.engine))


def state(worker: Worker) -> dict[str, Any]:
    reply = worker.client.get_weight_version()
    reply.pop("status")
    return reply


class Background:
    """A completion running in a thread."""

    def __init__(self, client: WorkerClient, **options: Any) -> None:
        self.result: dict[str, Any] = {}
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(client, options))
        self.thread.start()

    def _run(self, client: WorkerClient, options: dict[str, Any]) -> None:
        try:
            self.result = client.complete(**options)
        except Exception as exc:
            self.error = exc

    def join(self, timeout: float = 60) -> dict[str, Any]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "completion did not finish"
        assert self.error is None, self.error
        return self.result


def wait_for_tokens(worker: Worker, count: int) -> None:
    """Until the one running completion has generated more than ``count`` tokens."""
    wait_until(
        lambda: (
            bool(worker.engine.scheduler.active)
            and len(next(iter(worker.engine.scheduler.active.values())).out) > count
        )
    )


def wait_until(predicate: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- happy paths


# What each listed route answers to an empty body on a fresh, running reference worker, posted in
# this order: the reference engine implements every route, so none may answer 500 or 501 (a
# refused transport is a 501 ``not_supported``: test_unbuilt_transports_answer_501).
EMPTY_BODY_REPLIES: dict[str, tuple[int, str | None]] = {
    "abort_request": (400, "missing_field"),
    "abort_weight_update": (409, "no_session"),
    "begin_weight_update": (409, "not_paused"),
    "capabilities": (200, None),
    "clock": (200, None),
    "destroy_weights_update_group": (400, "missing_field"),
    "end_weight_update": (409, "no_session"),
    "engine_rpc": (400, "missing_field"),
    "flush_cache": (200, None),
    "get_weight_version": (200, None),
    "init_weights_update_group": (400, "missing_field"),
    "liveness_probe": (200, None),
    "pause_generation": (200, None),
    "resume_generation": (200, None),
    "release_memory": (409, "not_paused"),
    "resume_memory": (200, None),
    "set_weight_version": (400, "missing_field"),
    "update_weights_from_disk": (400, "missing_field"),
    "update_weights_from_distributed": (400, "missing_field"),
    "update_weights_from_plan": (400, "missing_field"),
    "update_weights_from_delta": (400, "missing_field"),
    "update_weights_from_tensor": (400, "missing_field"),
    "verify_weights": (200, None),
    "weight_info": (200, None),
}


def test_every_route_is_listed_and_served(worker: Worker) -> None:
    routes = worker.client.routes()
    assert routes["engine"] == "reference" and routes["world_size"] == 1
    assert sorted(routes["routes"]) == sorted(EMPTY_BODY_REPLIES), "a route came or went: pin its reply"
    for name, (status, code) in EMPTY_BODY_REPLIES.items():
        reply = post(worker, name, b"{}")
        body = reply.json()
        expected = (status, "ok" if status == 200 else "error", code)
        assert (reply.status_code, body["status"], body.get("code")) == expected, (name, body)


def test_versions_declare_and_read(worker: Worker) -> None:
    assert state(worker)["version_declared"] is False
    assert worker.client.set_weight_version(None)["version_declared"] is True
    assert state(worker) == {"version": None, "version_declared": True, "paused": False, "torn": False,
                             "update_in_flight": False, "digest": hashes_digest(worker),
                             "epoch": None, "version_digest": hashes_digest(worker),
                             "version_current": True, "session_open": False, "verified": True,
                             "weights": "resident", "kv_cache": "resident", "weights_released": False}  # fmt: skip
    worker.client.set_weight_version({"step": 3, "run": "a"})
    assert state(worker)["version"] == {"step": 3, "run": "a"}


def test_disk_update_happy_path_changes_outputs(worker: Worker) -> None:
    before = worker.client.complete([1, 2, 3, 4], max_tokens=12)["choices"][0]["token_ids"]
    ckpt = checkpoint(worker, "step-1", seed=5)
    assert worker.client.pause_generation("wait")["status"] == "ok"
    reply = worker.client.update_weights_from_disk(str(ckpt), weight_version="step-1")
    assert reply["version"] == "step-1" and reply["version_declared"] is True
    assert reply["prefix_cache_reset"] is True and reply["stats"]["files"] == 1
    worker.client.resume_generation()
    after = worker.client.complete([1, 2, 3, 4], max_tokens=12)
    assert after["weight_version"] == "step-1"
    assert after["choices"][0]["token_ids"] != before


def test_disk_update_of_a_checkpoint_without_a_manifest_is_reported_unverified(worker: Worker) -> None:
    """Without a manifest nothing checks the bytes read: the reply and the state say so,
    and a later update of a checkpoint with one makes the worker verified again."""
    bare = worker.root / "bare"
    bare.mkdir()
    save_file(perturbed(worker.engine.model.weights(), seed=6), str(bare / "model.safetensors"))
    worker.client.pause_generation()
    reply = worker.client.update_weights_from_disk(str(bare), weight_version="bare")
    assert reply["stats"]["verified"] == "none" and reply["verified"] is False
    assert state(worker)["verified"] is False
    reply = worker.client.update_weights_from_disk(str(checkpoint(worker, "full")), weight_version="full")
    assert reply["verified"] is True and state(worker)["verified"] is True


def test_update_without_version_reports_unknown_and_keeps_declaration(worker: Worker) -> None:
    worker.client.set_weight_version("v0")
    worker.client.pause_generation()
    reply = worker.client.update_weights_from_disk(str(checkpoint(worker, "c")))
    assert reply["version"] == "unknown" and reply["version_declared"] is False
    assert state(worker)["version"] == "v0"


def test_failed_update_leaves_outputs_byte_identical(worker: Worker) -> None:
    before = worker.client.complete("hello", max_tokens=16)
    bad = worker.root / "bad"
    bad.mkdir()
    weights = perturbed(worker.engine.model.weights())
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, str(bad / "model.safetensors"))
    worker.client.pause_generation()
    with pytest.raises(errors.InvalidRequest) as err:
        worker.client.update_weights_from_disk(str(bad), weight_version="bad")
    assert err.value.code == "shape_mismatch"
    worker.client.resume_generation()
    after = worker.client.complete("hello", max_tokens=16)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_weight_info_and_hash_rpc(worker: Worker) -> None:
    info = worker.client.weight_info()
    assert "model.embed_tokens.weight" in info["names"] and set(info["dtypes"]) == {"float32"}
    assert info["shapes"][info["names"].index("model.norm.weight")] == [64]
    rpc = worker.client.engine_rpc("weight_hashes")["result"]
    assert rpc == hashes(worker.engine)


def test_liveness_health_metrics_and_docs(worker: Worker) -> None:
    assert worker.client.liveness_probe()["alive"] is True
    assert httpx.get(f"{worker.url}/health").json()["alive"] is True
    worker.client.set_weight_version("m1")
    worker.client.pause_generation()
    worker.client.update_weights_from_disk(str(checkpoint(worker, "m")), weight_version="m2")
    metrics = httpx.get(f"{worker.url}/metrics").text
    assert "weightsync_paused 1.0" in metrics
    assert 'weightsync_version_info{type="string",version="m2"} 1.0' in metrics  # unquoted: a plain label
    assert 'weightsync_updates_total{code="ok",route="update_weights_from_disk"} 1.0' in metrics
    assert "weightsync_update_bytes_total" in metrics
    assert httpx.get(f"{worker.url}/docs").status_code == 200
    spec = httpx.get(f"{worker.url}/openapi.json").json()
    assert "/engine/update_weights_from_disk" in spec["paths"]


def test_flush_cache_reports_a_real_reset(worker: Worker) -> None:
    prompt = list(range(40))
    worker.client.complete(prompt, max_tokens=2)
    again = worker.client.complete(prompt, max_tokens=2)
    assert again["usage"]["cached_tokens"] == 32  # two cached 16-token blocks
    assert worker.client.flush_cache()["flushed"] is True
    assert worker.client.engine_rpc("prefix_cache_stats")["result"]["blocks"] == 0
    assert worker.client.complete(prompt, max_tokens=2)["usage"]["cached_tokens"] == 0


def test_flush_cache_is_refused_while_requests_hold_it(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(PACED)
    job = Background(worker.client, prompt=list(range(40)), max_tokens=200)
    wait_until(lambda: bool(worker.engine.in_flight()))
    wait_until(lambda: bool(worker.engine.scheduler.active))
    with pytest.raises(errors.IllegalState) as err:
        worker.client.flush_cache()
    assert err.value.code == "cache_in_use"
    worker.client.abort_request(worker.engine.in_flight()[0])
    assert job.join()["choices"][0]["finish_reason"] == "abort"


# ----------------------------------------------------------------------------- pause modes, live


def test_pause_keep_freezes_and_resume_continues(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(PACED)
    job = Background(worker.client, prompt="keep me", max_tokens=120)
    wait_until(
        lambda: (
            bool(worker.engine.scheduler.active)
            and len(next(iter(worker.engine.scheduler.active.values())).out) > 5
        )
    )
    reply = worker.client.pause_generation("keep")
    assert reply["aborted"] == 0
    frozen = len(next(iter(worker.engine.scheduler.active.values())).out)
    time.sleep(0.3)
    assert len(next(iter(worker.engine.scheduler.active.values())).out) == frozen, (
        "a kept request advanced while paused"
    )
    assert job.thread.is_alive()
    worker.client.resume_generation()
    out = job.join()
    assert out["choices"][0]["finish_reason"] == "length" and len(out["choices"][0]["token_ids"]) == 120


def test_pause_wait_replies_only_after_the_in_flight_request_finished(
    make_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(PACED)
    scheduler = worker.engine.scheduler
    finished: dict[str, tuple[str, float]] = {}  # request id -> (reason, when the engine finished it)
    finish = scheduler.finish

    def timed_finish(req: Any, reason: str) -> None:
        finished[req.id] = (reason, time.monotonic())
        finish(req, reason)

    monkeypatch.setattr(scheduler, "finish", timed_finish)
    job = Background(worker.client, prompt="drain me", max_tokens=60)  # ~0.6 s of generation
    wait_until(lambda: bool(scheduler.active))
    (running,) = scheduler.active.values()
    rid = running.id
    assert len(running.out) < 30, "the request was almost done before the pause: nothing to drain"
    reply = worker.client.pause_generation("wait")
    replied = time.monotonic()
    assert reply["status"] == "ok" and reply["aborted"] == 0
    assert worker.engine.in_flight() == [], "the pause replied while a request was still running"
    assert rid in finished, "the pause replied before the request finished"
    reason, when = finished[rid]
    assert reason == "length" and when < replied  # drained, not aborted, before the reply
    out = job.join()
    assert out["choices"][0]["finish_reason"] == "length" and len(out["choices"][0]["token_ids"]) == 60
    # new requests queue while paused, and run on resume
    queued = Background(worker.client, prompt="later", max_tokens=4)
    time.sleep(0.3)
    assert queued.thread.is_alive()
    worker.client.resume_generation()
    assert queued.join()["choices"][0]["finish_reason"] == "length"


def test_pause_abort_ends_requests_with_abort(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(PACED)
    jobs = [Background(worker.client, prompt=f"abort {i}", max_tokens=200) for i in range(2)]
    wait_until(lambda: len(worker.engine.scheduler.active) == 2)
    reply = worker.client.pause_generation("abort")
    assert reply["aborted"] == 2
    for job in jobs:
        out = job.join()
        assert out["choices"][0]["finish_reason"] == "abort"
        assert len(out["choices"][0]["token_ids"]) < 200


def test_unpaused_update_gives_a_running_completion_two_spans(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(PACED)
    worker.client.set_weight_version("old")
    ckpt = checkpoint(worker, "new")
    job = Background(worker.client, prompt="async rl", max_tokens=150)
    wait_for_tokens(worker, 10)
    reply = worker.client.update_weights_from_disk(str(ckpt), weight_version="new", allow_unpaused=True)
    assert reply["prefix_cache_reset"] is False and reply["stats"]["staged"] is True
    out = job.join()
    spans = out["weight_version_spans"]
    assert out["weight_version"] == "old"
    assert [s["version"] for s in spans] == ["old", "new"]
    assert spans[0]["first_token"] == 0 and spans[1]["last_token"] == 149
    assert spans[1]["first_token"] == spans[0]["last_token"] + 1


def test_sglangs_generate_reports_0_5_23_spans_and_the_last_spans_version(
    make_worker: Callable[..., Worker],
) -> None:
    """SGLang 0.5.23's ``meta_info``: ``weight_versions`` half-open ``{version, start, end}``
    and ``weight_version`` the *last* span's version (``add_weight_versions_to_meta_info`` in
    ``sglang/srt/utils/weight_versions.py``), for a generation an update landed in."""
    worker = make_worker(PACED)
    worker.client.set_weight_version("old")
    ckpt = checkpoint(worker, "new")
    out: list[Any] = []
    body = {"text": "async rl", "sampling_params": {"max_new_tokens": 150, "temperature": 0}}
    job = threading.Thread(
        target=lambda: out.append(httpx.post(f"{worker.url}/generate", json=body, timeout=120))
    )
    job.start()
    wait_for_tokens(worker, 10)
    worker.client.update_weights_from_disk(str(ckpt), weight_version="new", allow_unpaused=True)
    job.join()
    assert out[0].status_code == 200, out[0].text
    meta = out[0].json()["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["old", "new"] and meta["weight_version"] == "new"
    assert spans[0]["start"] == 0 and spans[1]["start"] == spans[0]["end"] and spans[1]["end"] == 150
    closed = meta["weight_version_spans"]  # weightsync's own, closed, say the same
    assert [(s["first_token"], s["last_token"] + 1) for s in closed] == [
        (s["start"], s["end"]) for s in spans
    ]


def test_an_unlabelled_update_mid_completion_starts_a_span_the_label_no_longer_describes(
    make_worker: Callable[..., Worker],
) -> None:
    """An update that omits weight_version keeps the label "A" on new weights: the tokens after
    it are a span of their own, "A" still, with version_current false and the new digest."""
    worker = make_worker(PACED)
    worker.client.set_weight_version("A")
    first_digest = worker.client.get_weight_version()["digest"]
    ckpt = checkpoint(worker, "unlabelled")
    job = Background(worker.client, prompt="async rl", max_tokens=150)
    wait_for_tokens(worker, 10)
    worker.client.update_weights_from_disk(str(ckpt), allow_unpaused=True)  # no weight_version
    after = worker.client.get_weight_version()
    assert after["version"] == "A" and after["version_current"] is False
    out = job.join()
    spans = out["weight_version_spans"]
    assert [(s["version"], s["version_current"]) for s in spans] == [("A", True), ("A", False)]
    assert spans[0]["digest"] == first_digest and spans[1]["digest"] == after["digest"] != first_digest
    assert spans[1]["first_token"] == spans[0]["last_token"] + 1 and spans[1]["last_token"] == 149


def test_keep_paused_update_resets_kept_requests_which_recompute(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(PACED)
    worker.client.set_weight_version("a")
    job = Background(worker.client, prompt=list(range(50)), max_tokens=100)
    wait_until(
        lambda: (
            bool(worker.engine.scheduler.active)
            and len(next(iter(worker.engine.scheduler.active.values())).out) > 5
        )
    )
    worker.client.pause_generation("keep")
    reply = worker.client.update_weights_from_disk(str(checkpoint(worker, "b")), weight_version="b")
    assert reply["prefix_cache_reset"] is True
    worker.client.resume_generation()
    out = job.join()
    assert [s["version"] for s in out["weight_version_spans"]] == ["a", "b"]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "code"),
    [(b"{not json", "invalid_json"), (b"[1, 2]", "not_an_object"), (b'"x"', "not_an_object"),
     (b'{"mode": "keep", "clear_cache": "false"}', "wrong_type"), (b'{"clear_cache": 0}', "wrong_type"),
     (b'{"surprise": true}', "unknown_field"), (b'{"mode": "later"}', "invalid_value"),
     (b'{"clear_cache": NaN}', "invalid_json"), (b"\xff\xfe", "invalid_json")],
)  # fmt: skip
def test_malformed_bodies_are_400_and_change_nothing(worker: Worker, body: bytes, code: str) -> None:
    before, weights = state(worker), hashes(worker.engine)
    reply = post(worker, "pause_generation", body)
    assert reply.status_code == 400
    assert reply.json()["status"] == "error" and reply.json()["code"] == code and reply.json()["message"]
    assert state(worker) == before and hashes(worker.engine) == weights


def test_malformed_request_is_400_even_when_the_state_would_refuse(worker: Worker) -> None:
    reply = post(worker, "update_weights_from_disk", b'{"model_path": "/x", "allow_unpaused": "no"}')
    assert reply.status_code == 400 and reply.json()["code"] == "wrong_type"


def test_update_while_running_is_409(worker: Worker) -> None:
    reply = post(
        worker, "update_weights_from_disk", json.dumps({"model_path": str(checkpoint(worker, "c"))}).encode()
    )
    assert reply.status_code == 409 and reply.json()["code"] == "not_paused"


def test_unknown_route_is_404_json(worker: Worker) -> None:
    reply = post(worker, "update_weights_from_cloud", b"{}")
    assert reply.status_code == 404 and reply.json()["code"] == "unknown_route"
    assert httpx.get(f"{worker.url}/engine/pause_generation").status_code == 405


def test_engine_rpc_refuses_names_off_the_allow_list(worker: Worker) -> None:
    reply = post(worker, "engine_rpc", b'{"method": "__init__"}')
    assert reply.status_code == 400 and reply.json()["code"] == "method_not_allowed"


def test_huge_body_is_413_and_server_keeps_serving(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(max_body_bytes=1024)
    reply = post(worker, "set_weight_version", json.dumps({"weight_version": "x" * 5000}).encode())
    assert reply.status_code == 413 and reply.json()["code"] == "payload_too_large"

    def chunks() -> Any:  # no content-length: the limit is enforced while streaming
        for _ in range(10):
            yield b" " * 512

    reply = httpx.post(f"{worker.url}/engine/set_weight_version", content=chunks(), headers=JSON)
    assert reply.status_code == 413
    assert state(worker)["version_declared"] is False
    assert worker.client.liveness_probe()["alive"]


def test_unbuilt_transports_answer_501(worker: Worker) -> None:
    worker.client.pause_generation()
    with pytest.raises(errors.NotSupported) as err:
        worker.client.update_weights_from_tensor(
            [{"name": "model.norm.weight", "dtype": "float32", "shape": [64], "handle": {"cuda_ipc": "AAAA"}}]
        )
    assert err.value.code == "not_supported" and err.value.http_status == 501
    assert not state(worker)["torn"]


def test_token_auth(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(api_key="s3cret")
    assert worker.client.get_weight_version()["status"] == "ok"
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
        reply = post(worker, "set_weight_version", b'{"weight_version": 1}', headers=headers)
        assert reply.status_code == 401 and reply.json()["code"] == "unauthorized"
    completions = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "x"})
    assert completions.status_code == 401
    assert state(worker)["version_declared"] is False
    assert httpx.get(f"{worker.url}/health").status_code == 200


def test_bad_input_does_not_disturb_an_in_flight_completion(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(PACED)
    reference = worker.client.complete("steady", max_tokens=60)
    job = Background(worker.client, prompt="steady", max_tokens=60)
    wait_until(lambda: bool(worker.engine.scheduler.active))
    for body in (b"{", b"[]", b'{"mode": 1}', b'{"x": 1}'):
        post(worker, "pause_generation", body)
    post(worker, "update_weights_from_disk", b'{"model_path": "/nope"}')
    assert job.join()["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]


def test_completion_validation(worker: Worker) -> None:
    for body in ({}, {"prompt": ""}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": 10_000},
                 {"prompt": [999]}, {"prompt": "x", "temperature": -1}, {"prompt": "x", "n": 0}, {"prompt": "x", "best": 2}):  # fmt: skip
        reply = httpx.post(f"{worker.url}/v1/completions", json=body)
        assert reply.status_code == 400, body
    sampled = [worker.client.complete("x", max_tokens=8, temperature=1.0, seed=7)["choices"][0]["token_ids"]
               for _ in range(2)]  # fmt: skip
    assert sampled[0] == sampled[1]


def test_return_weight_versions_gives_vllm_033s_half_open_spans(make_worker: Callable[..., Worker]) -> None:
    """vLLM 0.33's ``return_weight_versions``: ``choices[i].weight_versions`` as
    ``[{version, start, end}]``, half-open over the choice's tokens, on a whole reply and on the
    last event of a stream; absent unless asked."""
    worker = make_worker(PACED)
    worker.client.set_weight_version("old")
    ckpt = checkpoint(worker, "new")
    body = {"prompt": "spans", "max_tokens": 120, "return_weight_versions": True}
    job = Background(worker.client, **body)
    wait_for_tokens(worker, 10)
    worker.client.update_weights_from_disk(str(ckpt), weight_version="new", allow_unpaused=True)
    versions = job.join()["choices"][0]["weight_versions"]
    assert [v["version"] for v in versions] == ["old", "new"]
    assert (
        versions[0]["start"] == 0 and versions[1]["start"] == versions[0]["end"] and versions[1]["end"] == 120
    )
    plain = httpx.post(
        f"{worker.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60
    ).json()
    assert "weight_versions" not in plain["choices"][0]
    events = []
    with httpx.stream(
        "POST", f"{worker.url}/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True,
                                                      "return_weight_versions": True}, timeout=60,
    ) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
    last = [e for e in events if e["choices"] and e["choices"][0].get("finish_reason")]
    assert last[-1]["choices"][0]["weight_versions"] == [{"version": "new", "start": 0, "end": 5}]
    assert all("weight_versions" not in e["choices"][0] for e in events if e not in last)
