"""Labels that tell the truth: an update that omits weight_version keeps the declared label
(Dynamo's route contract), and every reply says whether that label still describes the
weights held — get_weight_version, the update's reply (which carries the resulting state)
and each completion's stamp."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.helpers import WorkerProcess, perturbed
from tests.workers import Worker
from weightsync.trainer import save_checkpoint, weights_digest

pytestmark = pytest.mark.integration


def _checkpoint(worker: Worker, name: str, seed: int) -> Path:
    return save_checkpoint(perturbed(dict(worker.engine.model.weights()), seed=seed), worker.root / name)


def test_an_update_without_a_version_says_the_kept_label_no_longer_describes_the_weights(
    worker: Worker,
) -> None:
    client = worker.client
    declared = client.set_weight_version("bf16")
    state = client.get_weight_version()
    assert (state["version"], state["version_current"]) == ("bf16", True)
    assert state["version_digest"] == state["digest"] == declared["digest"]

    client.pause_generation()
    reply = client.update_weights_from_disk(str(_checkpoint(worker, "step-1", seed=1)))
    # the route's own fields keep Dynamo's contract ...
    assert (reply["version"], reply["version_declared"]) == ("unknown", False)
    # ... and the resulting state says what is served now, with no second call
    assert reply["state"]["version"] == "bf16" and reply["state"]["version_declared"] is True
    assert reply["state"]["version_current"] is False
    assert reply["state"]["digest"] == reply["digest"] != reply["state"]["version_digest"]
    assert client.get_weight_version() == {"status": "ok", **reply["state"]}
    client.resume_generation()
    out = client.complete([1, 2, 3], max_tokens=4)
    assert out["weight_version"] == "bf16" and out["weight_version_current"] is False

    # a declaration makes the label true again, for the weights held now
    client.set_weight_version("step-1")
    state = client.get_weight_version()
    assert state["version_current"] is True and state["version_digest"] == state["digest"]
    assert client.complete([1, 2, 3], max_tokens=4)["weight_version_current"] is True


def test_an_update_with_a_version_describes_its_weights(worker: Worker) -> None:
    new = perturbed(dict(worker.engine.model.weights()), seed=2)
    path = save_checkpoint(new, worker.root / "step-2")
    worker.client.pause_generation()
    reply = worker.client.update_weights_from_disk(str(path), weight_version="step-2")
    assert reply["state"]["version"] == "step-2" and reply["state"]["version_current"] is True
    assert reply["state"]["version_digest"] == weights_digest(new)


def test_a_label_other_than_the_manifests_is_refused_unless_it_is_a_relabel(worker: Worker) -> None:
    """--version step-7 on a checkpoint whose manifest says step-5: 409 version_mismatch, before
    any write (the worker keeps its weights and label); relabel: true commits it as step-7; the
    manifest's own version, or none, goes through."""
    new = perturbed(dict(worker.engine.model.weights()), seed=5)
    path = save_checkpoint(new, worker.root / "step-5", version="step-5")
    client = worker.client
    client.set_weight_version("step-4")
    before = client.get_weight_version()
    client.pause_generation()
    response = httpx.post(
        f"{worker.url}/engine/update_weights_from_disk",
        json={"model_path": str(path), "weight_version": "step-7"},
    )
    assert response.status_code == 409, response.text
    assert response.json()["code"] == "version_mismatch" and "step-5" in response.json()["message"]
    after = client.get_weight_version()
    assert (after["version"], after["digest"], after["torn"]) == ("step-4", before["digest"], False)
    dry = httpx.post(
        f"{worker.url}/engine/update_weights_from_disk",
        json={"model_path": str(path), "weight_version": "step-7", "dry_run": True},
    )
    assert dry.status_code == 409  # a fleet's prepare sees it too
    reply = client.update_weights_from_disk(str(path), weight_version="step-5")
    assert reply["state"]["version"] == "step-5" and reply["state"]["digest"] == weights_digest(new)
    relabel = httpx.post(
        f"{worker.url}/engine/update_weights_from_disk",
        json={"model_path": str(path), "weight_version": "step-7", "relabel": True},
    )
    assert relabel.status_code == 200 and relabel.json()["state"]["version"] == "step-7"
    unnamed = save_checkpoint(new, worker.root / "unnamed")  # a writer that named no version
    assert client.update_weights_from_disk(str(unnamed), weight_version="any")["state"]["version"] == "any"


def test_reloading_the_same_weights_without_a_version_keeps_the_label_true(worker: Worker) -> None:
    path = _checkpoint(worker, "step-3", seed=3)
    worker.client.pause_generation()
    worker.client.update_weights_from_disk(str(path), weight_version="step-3")
    again = worker.client.update_weights_from_disk(str(path))
    assert again["state"]["version"] == "step-3" and again["state"]["version_current"] is True


def test_an_undeclared_worker_has_no_current_label(worker: Worker) -> None:
    state = worker.client.get_weight_version()
    assert state["version_declared"] is False and state["version_current"] is False
    assert state["version_digest"] is None


@pytest.mark.slow
def test_serve_require_version_refuses_an_update_without_weight_version(tmp_path: Path) -> None:
    from weightsync.engines.reference import ModelConfig, ReferenceEngine

    weights = ReferenceEngine(ModelConfig.tiny()).model.weights()
    path = save_checkpoint(perturbed(dict(weights), seed=4), tmp_path / "step-4")
    worker = WorkerProcess("--require-version", "--allowed-weight-dir", str(tmp_path)).wait_ready()
    try:
        url = f"{worker.url}/engine"
        httpx.post(f"{url}/pause_generation", json={})
        before = httpx.post(f"{url}/get_weight_version", json={}).json()
        refused = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(path)})
        assert refused.status_code == 400 and refused.json()["code"] == "version_required"
        assert httpx.post(f"{url}/get_weight_version", json={}).json() == before
        ok = httpx.post(
            f"{url}/update_weights_from_disk", json={"model_path": str(path), "weight_version": "s4"}
        )
        assert ok.status_code == 200 and ok.json()["state"]["version"] == "s4"
    finally:
        worker.stop()
