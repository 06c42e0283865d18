"""Deltas on a real vLLM engine (``weightsync serve --engine vllm``): a delta checkpoint A→B
that changes about 1 % of the elements of every tensor (the fused q/k/v and gate/up ones
included) takes a vLLM worker to the digest and the greedy outputs the same worker has after a
full load of B; on B the same delta is ``409 base_mismatch``; a delta that does not verify is
refused before vLLM sees a byte; a failure injected midway through vLLM's reload is undone (or,
when the undo fails too, leaves the worker torn).

One engine serves the module; each test starts with it on A (reloaded from disk when a test
left it elsewhere).  Faults are injected through the worker's ``WEIGHTSYNC_VLLM_DELTA_FAULT``
file (:mod:`weightsync.engines.vllm.delta`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.delta_helpers import changed, write_delta
from tests.vllm.servers import held, vllm_worker
from tests.vllm.test_vllm import greedy
from tests.vllm.tiny_llama import TinyLlamas
from weightsync.engines.vllm.delta import FAULT_ENV
from weightsync.trainer import WorkerClient, save_checkpoint
from weightsync.trainer.digest import weights_digest
from weightsync.transports.delta.manifest import DeltaManifest
from weightsync.transports.hashing import tensor_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

FUSED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


def _wrong_value_in_second_tensor(manifest: DeltaManifest, payload: dict[str, torch.Tensor]) -> None:
    """A value of a changed tensor after the first that does not make the target (the payload's
    checksums are written for it: only the check of the patched tensor can tell)."""
    entry = max(manifest.changed[1:], key=lambda t: t.numel)
    values = payload[entry.values or ""]
    values[0] = values[0] + 1.0


class Served:
    """The worker, A and B (A with about 1 % of every tensor's elements moved), the deltas
    between them, and what the worker answers on each after a full load."""

    def __init__(self, models: TinyLlamas) -> None:
        root = self.root = models.root
        self.a, self.a_tensors = models.a, models.a_tensors
        self.b_tensors = changed(self.a_tensors, 0.01, seed=11)
        self.b = save_checkpoint(self.b_tensors, root / "delta-b-full")
        self.sparse = write_delta(self.a_tensors, self.b_tensors, root / "delta-a-b")
        self.xor = write_delta(self.a_tensors, self.b_tensors, root / "delta-a-b-xor", encoding="xor")
        self.unverified = write_delta(self.a_tensors, self.b_tensors, root / "delta-a-b-wrong",
                                      edit=_wrong_value_in_second_tensor)  # fmt: skip
        self.fault = root / "delta-fault"
        self.fault.write_text("")
        self.worker = vllm_worker(self.a, root, "--vllm-delta-base", "copy", env={FAULT_ENV: str(self.fault)})
        try:
            self.client = WorkerClient(self.worker.url)
            self.a_outputs = greedy(self.client)
            self.load(self.b, "B-full")
            self.b_state = self.state()  # what a worker that loaded B in full reports
            self.b_outputs = greedy(self.client)
            self.load(self.a, "A")
            self.a_state = self.state()
        except BaseException:
            self.worker.stop()
            raise

    def state(self) -> dict[str, Any]:
        return self.client.get_weight_version()

    def load(self, path: Path, version: str) -> None:
        self.client.pause_generation("wait")
        self.client.update_weights_from_disk(str(path), weight_version=version)
        self.client.resume_generation()

    def delta(self, path: Path, version: str = "B") -> requests.Response:
        return requests.post(f"{self.worker.url}/engine/update_weights_from_delta",
                             json={"delta_path": str(path), "weight_version": version}, timeout=300)  # fmt: skip

    def resume(self) -> None:
        requests.post(f"{self.worker.url}/engine/resume_generation", json={}, timeout=60)


@pytest.fixture(scope="module")
def served(tiny_llamas: TinyLlamas) -> Iterator[Served]:
    with held(Served(tiny_llamas)) as s:
        yield s


@pytest.fixture
def worker(served: Served) -> Iterator[Served]:
    """The shared worker on A, paused; faults off and back on A afterwards."""
    served.fault.write_text("")
    if served.state()["digest"] != served.a_state["digest"] or served.state()["torn"]:
        served.load(served.a, "A")
    served.client.pause_generation("wait")
    yield served
    served.fault.write_text("")
    state = served.state()
    if state["torn"] or state["digest"] != served.a_state["digest"]:
        served.load(served.a, "A")
    served.client.resume_generation()


def test_the_module_weights_are_what_it_claims(served: Served) -> None:
    """B is 1 % of A's elements moved in every tensor, the fused ones included, and it answers
    otherwise than A (so equal outputs below mean something)."""
    for name, a in served.a_tensors.items():
        moved = int((a != served.b_tensors[name]).sum())
        assert 0 < moved <= max(1, a.numel() // 100), name
    assert all(any(f in n for n in served.a_tensors) for f in FUSED)
    assert served.b_state["digest"] == weights_digest(served.b_tensors) != served.a_state["digest"]
    assert served.b_outputs != served.a_outputs


@pytest.mark.parametrize("encoding", ["sparse", "xor"])
def test_a_delta_takes_a_vllm_worker_to_the_digest_and_outputs_of_a_full_load(
    worker: Served, encoding: str
) -> None:
    r = worker.delta(worker.sparse if encoding == "sparse" else worker.xor)
    assert r.status_code == 200, r.text
    delta = r.json()["stats"]["delta"]
    assert delta["encoding"] == encoding and delta["tensors_changed"] == len(worker.a_tensors)
    state = worker.state()
    assert (state["version"], state["torn"]) == ("B", False)
    assert state["digest"] == worker.b_state["digest"]  # what the same engine reports after a full load of B
    assert worker.client.engine_rpc("weight_hashes")["result"] == tensor_hashes(worker.b_tensors.items())
    worker.resume()
    assert greedy(worker.client) == worker.b_outputs


def test_the_delta_on_b_is_base_mismatch_and_changes_nothing(worker: Served) -> None:
    assert worker.delta(worker.sparse).status_code == 200
    r = worker.delta(worker.sparse, "C")
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["code"] == "base_mismatch" and body["details"]["held_digest"] == worker.b_state["digest"]
    state = worker.state()
    assert (state["version"], state["torn"], state["digest"]) == ("B", False, worker.b_state["digest"])
    worker.resume()
    assert greedy(worker.client) == worker.b_outputs


def test_a_delta_that_does_not_verify_is_refused_before_vllm_sees_it(worker: Served) -> None:
    r = worker.delta(worker.unverified)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["code"] == "delta_unverified" and "undone" not in body["details"]
    state = worker.state()
    assert (state["version"], state["torn"], state["digest"]) == ("A", False, worker.a_state["digest"])
    worker.resume()
    assert greedy(worker.client) == worker.a_outputs


def test_a_failure_midway_through_the_write_is_undone(worker: Served) -> None:
    worker.fault.write_text("write 7")  # vLLM took 7 tensors of the target, then the write fails
    r = worker.delta(worker.sparse)
    assert r.status_code >= 400, r.text
    body = r.json()
    assert body["details"]["undone"] is True and "injected" in body["message"], body
    state = worker.state()
    assert (state["version"], state["torn"], state["digest"]) == ("A", False, worker.a_state["digest"])
    assert worker.client.engine_rpc("weight_hashes")["result"] == tensor_hashes(worker.a_tensors.items())
    worker.resume()
    assert greedy(worker.client) == worker.a_outputs  # vLLM's kernels hold A again, not half of B


def test_when_the_undo_fails_too_the_worker_is_torn(worker: Served) -> None:
    worker.fault.write_text("write 7 undo")
    r = worker.delta(worker.sparse)
    assert r.status_code == 500 and r.json()["code"] == "weights_torn", r.text
    state = worker.state()
    assert state["torn"] is True and state["digest"] is None
    worker.fault.write_text("")
    worker.load(worker.a, "A")  # a full load mends it
    assert worker.state()["digest"] == worker.a_state["digest"]
    assert greedy(worker.client) == worker.a_outputs


def test_a_dry_run_checks_the_base_and_names_the_target_digest(worker: Served) -> None:
    r = requests.post(f"{worker.worker.url}/engine/update_weights_from_delta",
                      json={"delta_path": str(worker.sparse), "dry_run": True}, timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["digest"] == worker.b_state["digest"]
    assert worker.state()["digest"] == worker.a_state["digest"]
