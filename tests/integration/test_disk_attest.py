"""``verify_weights`` with ``allow_load_digest`` over a real loopback worker: the digest a disk
load took in the served memory stands in for a re-hash only while nothing wrote the weights
since; any later write through the control plane (a torn load, a partial load, a load through
a channel that hashes elsewhere) makes the worker hash what it serves again."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from tests.helpers import hashes, perturbed
from tests.workers import Worker
from weightsync.core.held import weights_digest
from weightsync.trainer import save_checkpoint, share_tensors
from weightsync.transports.disk import checks


def ok(worker: Worker, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = httpx.post(f"{worker.url}/engine/{route}", json=body or {}, timeout=30)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def served(worker: Worker) -> str:
    return weights_digest(hashes(worker.engine))


def load(worker: Worker, seed: int, **body: Any) -> dict[str, Any]:
    weights = perturbed(dict(worker.engine.model.weights()), seed=seed)
    path = save_checkpoint(weights, worker.root / f"ckpt-{seed}")
    return ok(worker, "update_weights_from_disk", {"model_path": str(path), **body})


def test_the_load_digest_stands_for_a_rehash_right_after_a_disk_load(
    worker: Worker, attests: list[int]
) -> None:
    ok(worker, "pause_generation")
    reply = load(worker, seed=1)
    verified = ok(worker, "verify_weights", {"allow_load_digest": True})
    assert verified["scope"] == "load_in_place" and verified["match"] is True
    assert verified["digest"] == reply["digest"] == served(worker)
    assert attests == []  # nothing was hashed again
    again = ok(worker, "verify_weights")  # the default still hashes what is served
    assert again["scope"] == "live_weights" and again["digest"] == verified["digest"] and attests == [1]


def test_a_staged_load_while_serving_is_attested_by_its_load_digest(worker: Worker) -> None:
    reply = load(worker, seed=2, allow_unpaused=True, reset_prefix_cache=False)
    assert reply["stats"]["staged"] is True  # hashed in the staging copy, which is now served
    verified = ok(worker, "verify_weights", {"allow_load_digest": True})
    assert (verified["scope"], verified["digest"]) == ("load_in_place", served(worker))


def test_a_torn_load_after_the_disk_load_is_hashed_again(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok(worker, "pause_generation")
    first = load(worker, seed=1)["digest"]
    copy = checks.DiskCheckpoint.copy_into

    def dies_after_one_tensor(self: checks.DiskCheckpoint, sink: Any, *args: Any) -> Any:
        spec = next(iter(self.entries)).spec
        sink.write(spec.name, torch.ones(spec.shape))
        raise OSError("injected: the disk died")

    monkeypatch.setattr(checks.DiskCheckpoint, "copy_into", dies_after_one_tensor)
    weights = perturbed(dict(worker.engine.model.weights()), seed=3)
    path = save_checkpoint(weights, worker.root / "torn")
    torn = httpx.post(
        f"{worker.url}/engine/update_weights_from_disk", json={"model_path": str(path)}, timeout=30
    )
    assert torn.status_code == 500
    monkeypatch.setattr(checks.DiskCheckpoint, "copy_into", copy)
    verified = ok(worker, "verify_weights", {"allow_load_digest": True})
    assert verified["scope"] == "live_weights" and verified["match"] is False
    assert verified["digest"] == served(worker) != first


def test_a_partial_load_after_the_disk_load_is_hashed_again(worker: Worker) -> None:
    ok(worker, "pause_generation")
    load(worker, seed=1)
    name = "model.norm.weight"
    part = save_checkpoint({name: worker.engine.model.weights()[name] + 1}, worker.root / "part")
    ok(worker, "update_weights_from_disk", {"model_path": str(part), "allow_partial": True})
    # The partial load hashed one tensor in place; the others were hashed by the load before,
    # so only a re-hash can say what they hold now (here: changed behind the control plane).
    with torch.no_grad():
        worker.engine.model.weights()["model.embed_tokens.weight"].add_(1.0)
    verified = ok(worker, "verify_weights", {"allow_load_digest": True})
    assert verified["scope"] == "live_weights" and verified["match"] is False
    assert verified["digest"] == served(worker)


def test_a_load_through_shared_memory_after_the_disk_load_is_hashed_again(worker: Worker) -> None:
    ok(worker, "pause_generation")
    first = load(worker, seed=1)["digest"]
    weights = perturbed(dict(worker.engine.model.weights()), seed=4)
    with share_tensors(weights) as shared:
        ok(worker, "update_weights_from_tensor", {"tensors": shared.tensors})
    verified = ok(worker, "verify_weights", {"allow_load_digest": True})
    assert verified["scope"] == "live_weights"  # that channel hashes as it copies, not in place
    assert verified["digest"] == served(worker) == weights_digest(hashes(worker.engine)) != first


def test_a_dtype_cast_disk_load_is_attested_by_the_hash_of_what_it_became(worker: Worker) -> None:
    ok(worker, "pause_generation")
    weights = perturbed(dict(worker.engine.model.weights()), seed=5, dtype=torch.float16)
    path = save_checkpoint(weights, worker.root / "fp16")
    ok(worker, "update_weights_from_disk", {"model_path": str(path), "allow_dtype_cast": True})
    verified = ok(worker, "verify_weights", {"allow_load_digest": True})
    assert (verified["scope"], verified["digest"]) == ("load_in_place", served(worker))


def test_allow_load_digest_must_be_a_boolean(worker: Worker) -> None:
    reply = httpx.post(f"{worker.url}/engine/verify_weights", json={"allow_load_digest": "true"}, timeout=30)
    assert (reply.status_code, reply.json()["code"]) == (400, "wrong_type")


def test_the_load_digest_survives_a_kv_release_but_not_weights_that_moved(
    worker: Worker, attests: list[int]
) -> None:
    """Releasing only the KV cache leaves the weights where the load hashed them; offloading
    and restoring them writes their memory again, so only a rehash may vouch for them."""
    ok(worker, "pause_generation")
    load(worker, seed=1)
    ok(worker, "release_memory", {"weights": "keep"})
    ok(worker, "resume_memory")
    assert ok(worker, "verify_weights", {"allow_load_digest": True})["scope"] == "load_in_place"
    ok(worker, "release_memory", {"weights": "offload"})
    ok(worker, "resume_memory")
    verified = ok(worker, "verify_weights", {"allow_load_digest": True})
    assert verified["scope"] == "live_weights" and verified["match"] is True
    assert verified["digest"] == served(worker)
