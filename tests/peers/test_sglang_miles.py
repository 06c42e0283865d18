"""Miles (slime's successor, radixark/miles) driving a weightsync worker with exactly the calls
its ``SGLangEngine`` makes (``miles/backends/sglang_utils/sglang_engine.py``, reproduced in
:mod:`tests.peers.sglang_calls`: Miles needs sglang, which does not install beside the pinned
torch here).

- start-up: ``_wait_server_healthy`` (``GET /health_generate`` until 200 with Miles' headers,
  ``Authorization: Bearer None`` included, then ``GET /flush_cache`` until 200), then
  ``health_generate``, ``get_weight_version`` (``/model_info``) and ``get_server_info``
  (``/server_info``) against a real ``weightsync serve`` process;
- a refit as ``update_weight_from_distributed/broadcast.py`` and ``mixin.py`` run it:
  ``destroy_weights_update_group`` (tolerating the 400 of a fresh engine),
  ``init_weights_update_group`` beside rank 0's rendezvous (group ``miles-pp_0``), then
  pause (``retract``), ``flush_cache``, ``begin_weight_update {"selector": "all"}``,
  ``update_weights_from_distributed`` with ``selector``, ``flush_cache: false`` and
  ``weight_version`` while rank 0 broadcasts, ``end_weight_update``, ``continue_generation``;
- ``update_weights_from_disk`` (a frozen model's reload) and the refusals Miles can meet
  (``selector: "draft"``, pickled ``serialized_named_tensors``).

Rank 0 forms its group as Miles does (``miles/utils/distributed_utils.py`` ``init_process_group``,
the same copy of torch's as SGLang's ``init_custom_process_group``: ``PrefixStore(group_name)``)
and broadcasts with ``dist.broadcast(..., async_op=True)``; every HTTP call is Miles'.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import requests
import torch
import torch.distributed as dist

from tests.helpers import TINY, WorkerProcess, perturbed
from tests.peers.sglang_calls import MilesEngine, miles_refit, miles_rollout
from tests.peers.sglang_worker import SglangWorker, rank0_beside, sglang_worker
from weightsync.core import Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.engines.reference.model import CausalLM
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import weights_digest

__all__ = ["sglang_worker"]

GROUP = "miles-pp_0"


@pytest.mark.slow
def test_miles_start_up_wait_returns_on_a_starting_weightsync_serve_process(tmp_path: Path) -> None:
    worker = WorkerProcess("--allowed-weight-dir", str(tmp_path))  # not waited for: Miles waits
    try:
        engine = MilesEngine(worker.url)
        deadline = time.monotonic() + 120  # Miles waits for ever; a test gives up
        calls = engine.wait_server_healthy(
            api_key=None,
            is_process_alive=lambda: worker.proc.poll() is None and time.monotonic() < deadline,
            sleep_s=0.2,
        )
        assert calls >= 1
        assert engine.health_generate() is True
        assert engine.get_weight_version() == "default"
        info = engine.get_server_info()
        assert info["model_path"] == "reference" and info["weight_version"] == "default"
        assert info["internal_states"][0]["status"] == "Up" and info["tp_size"] == 1
        # Miles' external engines (--rollout-external): SGLangEngine._init_external asserts that
        # every server argument it computed for the engine equals the server's own
        expected = {
            "host": "127.0.0.1", "port": worker.port, "nnodes": 1, "node_rank": 0, "gpu_id_step": 1,
            "base_gpu_id": 0, "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
            "enable_memory_saver": True,  # the reference engine releases and restores memory
            "load_format": "auto", "dtype": "float32",
        }  # fmt: skip
        assert {key: info.get(key) for key in expected} == expected
        model = requests.get(f"{worker.url}/model_info", timeout=10).json()  # SGLang 0.5.23's fields
        assert model["weight_version"] == "default" and model["served_model_name"] == "reference"
        assert model["load_format"] == "auto"
    finally:
        worker.stop()


def connect(engine: MilesEngine) -> Any:
    """``connect_rollout_engines_from_distributed`` for one engine of one GPU: the engine's
    ``init_weights_update_group`` beside rank 0 joining (Miles' ``init_process_group``)."""
    engine.destroy_weights_update_group(GROUP)  # disconnect first: a fresh engine answers 400

    def join(port: int) -> None:
        reply = engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")
        assert reply["success"] is True, reply

    return rank0_beside(GROUP, join)


@pytest.mark.slow
def test_miles_distributed_refit_with_selector_commits_the_trainers_weights(
    sglang_worker: SglangWorker,
) -> None:
    engine = MilesEngine(sglang_worker.url)
    group = connect(engine)
    try:
        for weight_version in (1, 2):
            new = perturbed(sglang_worker.engine.model.weights(), seed=20 + weight_version)
            reply = miles_refit(
                engine, lambda t: dist.broadcast(t, 0, group=group, async_op=True), GROUP, weight_version, new
            )
            assert reply["success"] is True, reply
            assert engine.get_weight_version() == str(weight_version)
            served = sglang_worker.engine.model.weights()
            assert all(torch.equal(served[name], new[name]) for name in new)
            snap = sglang_worker.controller.snapshot()
            assert snap.digest == weights_digest(new) and not snap.paused and not snap.session_open
            assert engine.health_generate() is True
        assert engine.destroy_weights_update_group(GROUP)["success"] is True
    finally:
        dist.destroy_process_group(group)


def test_miles_disk_reload_with_a_version_and_model_info_following_it(sglang_worker: SglangWorker) -> None:
    engine = MilesEngine(sglang_worker.url)
    path = sglang_worker.other_model("frozen", seed=5)
    reply = engine.update_weights_from_disk(path, weight_version="3")
    assert reply["success"] is True and "3" in reply["message"], reply
    assert engine.get_weight_version() == "3"
    info = sglang_worker.get("/get_model_info").json()
    assert info["model_path"] == path and info["weight_version"] == "3"
    assert engine.get_server_info()["model_path"] == path


def test_miles_calls_a_worker_cannot_honour_are_refused_in_sglangs_shape_and_change_nothing(
    sglang_worker: SglangWorker,
) -> None:
    engine = MilesEngine(sglang_worker.url)
    before = sglang_worker.controller.snapshot()
    refusals = {
        "begin draft": lambda: engine.begin_weight_update(selector="draft"),
        "update draft": lambda: engine.update_weights_from_distributed(
            ["lm_head.weight"], [torch.float32], [[1, 1]], GROUP, selector="draft"
        ),
        "pickled tensors": lambda: engine.update_weights_from_tensor(["gAR9lC4="]),
    }
    codes = {}
    for what, call in refusals.items():
        with pytest.raises(requests.HTTPError) as caught:
            call()
        body = caught.value.response.json()
        assert caught.value.response.status_code == 400 and body["success"] is False, what
        codes[what] = body["code"]
    assert codes == {"begin draft": "not_supported", "update draft": "not_supported",
                     "pickled tensors": "pickle_refused"}  # fmt: skip
    assert sglang_worker.controller.snapshot() == before


@pytest.mark.slow
def test_miles_check_weight_update_equal_proves_the_refit_rewrote_every_tensor(
    sglang_worker: SglangWorker,
) -> None:
    """Miles' ``--check-weight-update-equal`` (``miles/ray/placement_group.py``
    ``create_rollout_manager``, ``train.py``): ``weights_checker`` ``snapshot``, then
    ``reset_tensors``, then the first refit, then ``compare``.  A refit of the weights the
    snapshot saw compares equal; one that leaves a tensor out cannot commit, and one that
    sends other bytes compares unequal, naming the tensor."""
    engine = MilesEngine(sglang_worker.url)
    launched = {name: t.clone() for name, t in sglang_worker.engine.model.weights().items()}
    assert engine.check_weights("snapshot")["success"] is True
    reset = engine.check_weights("reset_tensors")
    assert reset["success"] is True and reset["weights_released"] is True
    snap = sglang_worker.controller.snapshot()
    assert snap.paused and snap.weights_released  # nothing served until an update rewrites them
    with pytest.raises(requests.HTTPError):
        engine.health_generate()
    group = connect(engine)
    try:
        reply = miles_refit(
            engine, lambda t: dist.broadcast(t, 0, group=group, async_op=True), GROUP, 1, launched
        )
        assert reply["success"] is True, reply
        assert engine.check_weights("compare")["success"] is True
        with pytest.raises(requests.HTTPError) as again:  # SGLang forgets the snapshot after a compare
            engine.check_weights("compare")
        assert again.value.response.json()["code"] == "no_snapshot"
        # the same check after a refit of other bytes in one tensor: compare names it
        assert engine.check_weights("snapshot")["success"] is True
        changed = dict(launched)
        changed["lm_head.weight"] = perturbed({"w": launched["lm_head.weight"]}, seed=3)["w"]
        reply = miles_refit(
            engine, lambda t: dist.broadcast(t, 0, group=group, async_op=True), GROUP, 2, changed
        )
        assert reply["success"] is True, reply
        with pytest.raises(requests.HTTPError) as differ:
            engine.check_weights("compare")
        body = differ.value.response.json()
        assert differ.value.response.status_code == 400 and body["success"] is False
        assert body["code"] == "weights_differ" and "lm_head.weight" in body["message"]
        assert "1 tensor(s)" in body["message"]
        assert engine.destroy_weights_update_group(GROUP)["success"] is True
    finally:
        dist.destroy_process_group(group)


def test_miles_checksums_name_the_served_bytes_and_agree_between_workers_holding_them(
    sglang_worker: SglangWorker,
) -> None:
    """``check_weights("checksum")`` as Miles reads it (``miles/utils/audit_utils/
    checksum_utils.py``: ``ranks[*].checksums`` keyed by ``parallelism_info[*].rank``): the
    checksums are the served tensors' hashes, equal on a second worker loading the same
    checkpoint, and change with the weights; ``skip_tensor_list`` leaves names out."""
    engine = MilesEngine(sglang_worker.url)
    first = engine.check_weights("checksum")
    assert first["success"] is True and len(first["ranks"]) == 1
    rank = first["ranks"][0]
    assert {info["rank"] for info in rank["parallelism_info"]} == {0}
    assert rank["parallelism_info"][0]["role"] == "target" and rank["parallelism_info"][0]["tp_size"] == 1
    assert set(rank["checksums"]) == set(sglang_worker.engine.model.weights())
    assert all(len(v) == 16 for v in rank["checksums"].values())
    other = ReferenceEngine(attrs.evolve(TINY, seed=99), allowed_weight_dirs=[sglang_worker.root])
    with ServerThread(create_app(Controller(other))) as server:  # another worker, other weights
        second = MilesEngine(server.url)
        assert second.check_weights("checksum")["per_engine_checksum"] != first["per_engine_checksum"]
        second.update_weights_from_disk(sglang_worker.model_path, weight_version="same")
        same = second.check_weights("checksum")
    assert same["per_engine_checksum"] == first["per_engine_checksum"]
    assert same["ranks"][0]["checksums"] == rank["checksums"]
    skipped = engine.check_weights("checksum", skip_list=["lm_head"])
    assert not any("lm_head" in name for name in skipped["ranks"][0]["checksums"])
    assert skipped["per_engine_checksum"] != first["per_engine_checksum"]
    engine.update_weights_from_disk(sglang_worker.other_model("moved", seed=9), weight_version="9")
    moved = engine.check_weights("checksum")
    assert moved["per_engine_checksum"] != first["per_engine_checksum"]
    assert moved["ranks"][0]["checksums"]["lm_head.weight"] != rank["checksums"]["lm_head.weight"]


def test_miles_parallelism_info_and_refused_checks_change_nothing(sglang_worker: SglangWorker) -> None:
    engine = MilesEngine(sglang_worker.url)
    info = engine.get_parallelism_info(rank=0)
    assert info["tp_size"] == 1 and info["tp_rank"] == 0 and info["world_size"] == 1
    assert info["global_rank"] == 0 and info["pp_size"] == 1 and info["attn_dp_size"] == 1
    before = sglang_worker.controller.snapshot()
    for call, code in (
        (lambda: engine.get_parallelism_info(rank=1), "invalid_value"),
        (lambda: engine.check_weights("explode"), "invalid_value"),
        (lambda: engine.check_weights("checksum", selector="draft"), "not_supported"),
        (lambda: engine.check_weights("reset_tensors", skip_list=["lm_head"]), "not_supported"),
        (lambda: engine.check_weights("compare"), "no_snapshot"),
    ):
        with pytest.raises(requests.HTTPError) as caught:
            call()
        assert caught.value.response.status_code == 400
        assert caught.value.response.json()["code"] == code
    assert sglang_worker.controller.snapshot() == before


@pytest.mark.slow
def test_miles_rollouts_between_refits_carry_the_version_and_logprobs_of_the_weights_that_made_them(
    sglang_worker: SglangWorker,
) -> None:
    """Miles' loop on one engine: a refit (version 1), single-turn rollouts as Miles generates
    them (``miles_rollout``: its payload and its parsing of the reply into a ``Sample``), a
    second refit (version 2), rollouts again.  Each sample records the version its weights were
    committed as (``meta_info.weight_version``, which Miles appends to ``Sample.weight_versions``)
    and its log-probabilities are those of those weights (a direct forward)."""
    engine = MilesEngine(sglang_worker.url)
    group = connect(engine)
    prompt = list(b"Miles rolls out")
    try:
        for weight_version in (1, 2):
            new = perturbed(sglang_worker.engine.model.weights(), seed=40 + weight_version)
            new = {name: t.clone() for name, t in new.items()}
            reply = miles_refit(
                engine, lambda t: dist.broadcast(t, 0, group=group, async_op=True), GROUP, weight_version, new
            )
            assert reply["success"] is True, reply
            for seed in (1, 2):
                sample = miles_rollout(
                    sglang_worker.url,
                    prompt,
                    {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": seed},
                )
                assert sample.status == "truncated" and sample.response_length == 6
                assert sample.weight_versions == [str(weight_version)]
                assert sample.tokens[: len(prompt)] == prompt and len(sample.tokens) == len(prompt) + 6
                assert sample.total_prompt_tokens == len(prompt)
                with torch.no_grad():
                    model = CausalLM(TINY, slots=1)
                    for name, served in model.weights().items():
                        served.copy_(new[name])
                    lp = torch.log_softmax(model.forward_full(torch.tensor([sample.tokens]))[0].float(), -1)
                assert sample.rollout_log_probs is not None
                for i, value in enumerate(sample.rollout_log_probs):
                    token = sample.tokens[len(prompt) + i]
                    assert abs(value - float(lp[len(prompt) + i - 1, token])) < 1e-4
        assert engine.destroy_weights_update_group(GROUP)["success"] is True
    finally:
        dist.destroy_process_group(group)
