"""The worker side of fleet transactions over real loopback HTTP: the content digest, the
fleet epoch, dry runs, guarded declarations and verify_weights."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.helpers import hashes, perturbed
from tests.workers import Worker
from weightsync.core.held import weights_digest
from weightsync.trainer import save_checkpoint, share_tensors
from weightsync.transports.disk import MANIFEST_NAME, checks


def post(worker: Worker, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{worker.url}/engine/{route}", json=body or {}, timeout=30)


def ok(worker: Worker, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = post(worker, route, body)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def status(worker: Worker) -> dict[str, Any]:
    return ok(worker, "get_weight_version")


def served_digest(worker: Worker) -> str:
    return weights_digest(hashes(worker.engine))


def checkpoint(worker: Worker, name: str, seed: int = 1, **kw: Any) -> Path:
    return save_checkpoint(
        perturbed(dict(worker.engine.model.weights()), seed=seed), worker.root / name, **kw
    )


def manifest_digest(path: Path) -> str:
    return str(json.loads((path / MANIFEST_NAME).read_text())["digest"])


def test_fresh_worker_reports_the_digest_of_its_seeded_weights(worker: Worker) -> None:
    st = status(worker)
    assert st["digest"] == served_digest(worker) and st["epoch"] is None
    same = save_checkpoint(dict(worker.engine.model.weights()), worker.root / "same")
    assert manifest_digest(same) == st["digest"]


def test_update_reply_and_state_carry_the_checkpoint_digest(worker: Worker) -> None:
    ckpt = checkpoint(worker, "c1")
    ok(worker, "pause_generation")
    reply = ok(worker, "update_weights_from_disk", {"model_path": str(ckpt)})
    assert reply["digest"] == manifest_digest(ckpt) == served_digest(worker)
    assert status(worker)["digest"] == reply["digest"]


def test_partial_update_replaces_only_its_entries(worker: Worker) -> None:
    weights = dict(worker.engine.model.weights())
    name = "model.norm.weight"
    part = save_checkpoint({name: weights[name] + 1}, worker.root / "part")
    ok(worker, "pause_generation")
    reply = ok(worker, "update_weights_from_disk", {"model_path": str(part), "allow_partial": True})
    assert reply["digest"] == served_digest(worker) != manifest_digest(part)


def test_torn_update_makes_the_digest_unknown_until_a_complete_update(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = checkpoint(worker, "c1")
    copy = checks.DiskCheckpoint.copy_into

    def dies_after_one_tensor(self: checks.DiskCheckpoint, sink: Any, *args: Any) -> None:
        first = next(iter(self.entries)).spec
        sink.write(first.name, torch.zeros(first.shape))
        raise OSError("injected: the disk died")

    monkeypatch.setattr(checks.DiskCheckpoint, "copy_into", dies_after_one_tensor)
    ok(worker, "pause_generation")
    assert post(worker, "update_weights_from_disk", {"model_path": str(ckpt)}).status_code == 500
    st = status(worker)
    assert st["torn"] and st["digest"] is None
    assert post(worker, "verify_weights").json()["match"] is False
    monkeypatch.setattr(checks.DiskCheckpoint, "copy_into", copy)
    assert ok(worker, "update_weights_from_disk", {"model_path": str(ckpt)})["digest"] == manifest_digest(
        ckpt
    )


def test_refused_update_leaves_the_digest_unchanged(worker: Worker) -> None:
    before = status(worker)["digest"]
    ok(worker, "pause_generation")
    reply = post(worker, "update_weights_from_disk", {"model_path": str(worker.root / "nope")})
    assert reply.status_code == 404 and status(worker)["digest"] == before


def test_dry_run_is_legal_while_running_and_changes_nothing(worker: Worker) -> None:
    ckpt = checkpoint(worker, "c1")
    before, served = status(worker), served_digest(worker)
    reply = ok(worker, "update_weights_from_disk", {"model_path": str(ckpt), "dry_run": True})
    state = {k: v for k, v in before.items() if k != "status"}
    assert reply == {
        "status": "ok",
        "dry_run": True,
        "digest": manifest_digest(ckpt),
        "epoch": None,
        "state": state,
    }
    assert status(worker) == before and served_digest(worker) == served
    assert worker.controller.snapshot().commits == 0


def test_dry_run_is_legal_while_torn(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = checkpoint(worker, "c1")

    def dies(self: checks.DiskCheckpoint, sink: Any, *args: Any) -> None:
        first = next(iter(self.entries)).spec
        sink.write(first.name, torch.zeros(first.shape))
        raise OSError("injected")

    monkeypatch.setattr(checks.DiskCheckpoint, "copy_into", dies)
    ok(worker, "pause_generation")
    post(worker, "update_weights_from_disk", {"model_path": str(ckpt)})
    assert status(worker)["torn"]
    reply = ok(worker, "update_weights_from_disk", {"model_path": str(ckpt), "dry_run": True})
    # the current map is unknown, but a complete checkpoint replaces all of it
    assert reply["digest"] == manifest_digest(ckpt) and status(worker)["torn"]


def test_dry_run_of_a_partial_checkpoint_merges_over_the_current_map(worker: Worker) -> None:
    weights = dict(worker.engine.model.weights())
    name = "model.norm.weight"
    part = save_checkpoint({name: weights[name] + 1}, worker.root / "part")
    expected = weights_digest(
        {**hashes(worker.engine), name: json.loads((part / MANIFEST_NAME).read_text())["tensors"][name]}
    )
    reply = ok(
        worker, "update_weights_from_disk", {"model_path": str(part), "allow_partial": True, "dry_run": True}
    )
    assert reply["digest"] == expected


@pytest.mark.parametrize(
    ("damage", "status_code", "code"),
    [
        ("truncate", 400, "corrupt_checkpoint"),
        ("flip", 400, "manifest_mismatch"),
        ("missing", 404, "path_not_found"),
    ],
)
def test_dry_run_refuses_what_the_update_would_refuse(
    worker: Worker, damage: str, status_code: int, code: str
) -> None:
    ckpt = checkpoint(worker, "bad")
    shard = next(ckpt.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(bytes(data[:-7]))
    elif damage == "flip":
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = status(worker)
    path = str(ckpt if damage != "missing" else worker.root / "missing")
    reply = post(worker, "update_weights_from_disk", {"model_path": path, "dry_run": True})
    assert (reply.status_code, reply.json()["code"]) == (status_code, code)
    assert status(worker) == before


def test_dry_run_of_shared_memory_checks_the_handles(worker: Worker) -> None:
    weights = dict(worker.engine.model.weights())
    with share_tensors(perturbed(weights)) as shared:
        body = {"tensors": shared.tensors, "dry_run": True}
        assert ok(worker, "update_weights_from_tensor", body)["digest"] is None
        bad = [dict(t, shape=[1]) for t in shared.tensors]
        reply = post(worker, "update_weights_from_tensor", {"tensors": bad, "dry_run": True})
        assert (reply.status_code, reply.json()["code"]) == (400, "shape_mismatch")
    assert served_digest(worker) == status(worker)["digest"] == weights_digest(hashes(worker.engine))


@pytest.mark.parametrize(
    "body",
    [
        {"weight_version": "v", "epoch": -1},
        {"weight_version": "v", "epoch": True},
        {"weight_version": "v", "epoch": 2**63},
        {"weight_version": "v", "expected_digest": "ABCDEF"},
        {"weight_version": "v", "expected_digest": ""},
        {"weight_version": "v", "expected_digest": 12},
    ],
)
def test_malformed_guards_are_400(worker: Worker, body: dict[str, Any]) -> None:
    before = status(worker)
    reply = post(worker, "set_weight_version", body)
    assert reply.status_code == 400 and reply.json()["code"] in ("invalid_value", "wrong_type")
    assert status(worker) == before


def test_dry_run_must_be_a_boolean(worker: Worker) -> None:
    reply = post(worker, "update_weights_from_disk", {"model_path": "/x", "dry_run": "true"})
    assert (reply.status_code, reply.json()["code"]) == (400, "wrong_type")


def test_declare_with_the_wrong_digest_is_refused_and_changes_nothing(worker: Worker) -> None:
    before = status(worker)
    reply = post(
        worker, "set_weight_version", {"weight_version": "v1", "epoch": 1, "expected_digest": "00" * 16}
    )
    assert (reply.status_code, reply.json()["code"]) == (409, "digest_mismatch")
    assert status(worker) == before


def test_declare_sets_the_epoch_and_an_epoch_never_goes_backwards(worker: Worker) -> None:
    digest = status(worker)["digest"]
    reply = ok(worker, "set_weight_version", {"weight_version": "v2", "epoch": 2, "expected_digest": digest})
    assert (reply["version"], reply["epoch"], reply["digest"]) == ("v2", 2, digest)
    stale = post(worker, "set_weight_version", {"weight_version": "v1", "epoch": 1})
    assert (stale.status_code, stale.json()["code"]) == (409, "stale_epoch")
    assert (status(worker)["version"], status(worker)["epoch"]) == ("v2", 2)
    assert ok(worker, "set_weight_version", {"weight_version": "v2b", "epoch": 2})["epoch"] == 2
    assert ok(worker, "set_weight_version", {"weight_version": "v3"})["epoch"] == 2  # no epoch: kept


def test_a_declaration_read_after_its_not_after_is_refused_and_changes_nothing(worker: Worker) -> None:
    """New with ``not_after``: a fleet commit that reaches a worker after its coordinator gave
    up on it (the worker was stopped while the request sat in its socket) is refused."""
    digest = status(worker)["digest"]
    ok(worker, "set_weight_version", {"weight_version": "v4", "epoch": 4, "expected_digest": digest})
    before = status(worker)
    late = {"weight_version": "v5", "epoch": 5, "expected_digest": digest, "not_after": time.time() - 1}
    reply = post(worker, "set_weight_version", late)
    assert (reply.status_code, reply.json()["code"]) == (409, "commit_expired"), reply.text
    assert reply.json()["details"]["not_after"] == late["not_after"]
    assert status(worker) == before
    fresh = {**late, "not_after": time.time() + 600}
    assert ok(worker, "set_weight_version", fresh)["epoch"] == 5
    assert (status(worker)["version"], status(worker)["epoch"]) == ("v5", 5)


@pytest.mark.parametrize(
    ("not_after", "code"),
    [
        ("1767225600", "wrong_type"),
        (True, "wrong_type"),
        (None, "wrong_type"),
        ([1.0], "wrong_type"),
        (0, "invalid_value"),
        (-5.5, "invalid_value"),
        (10**400, "invalid_value"),
        (1e300, "invalid_value"),
    ],
)
def test_not_after_must_be_a_positive_finite_number_of_unix_seconds(
    worker: Worker, not_after: Any, code: str
) -> None:
    before = status(worker)
    reply = post(worker, "set_weight_version", {"weight_version": "bad", "not_after": not_after})
    assert (reply.status_code, reply.json()["code"]) == (400, code), reply.text
    assert reply.json()["details"]["field"] == "not_after"
    assert status(worker) == before


def test_a_not_after_that_is_not_json_is_refused_before_it_is_read(worker: Worker) -> None:
    before = status(worker)
    for raw in (
        b'{"weight_version": "bad", "not_after": NaN}',
        b'{"weight_version": "bad", "not_after": Infinity}',
    ):
        reply = httpx.post(
            f"{worker.url}/engine/set_weight_version",
            content=raw,
            headers={"content-type": "application/json"},
        )
        assert (reply.status_code, reply.json()["code"]) == (400, "invalid_json"), reply.text
    assert status(worker) == before


def test_verify_weights_catches_a_write_outside_the_control_plane(worker: Worker) -> None:
    first = ok(worker, "verify_weights")
    assert first["match"] is True and first["digest"] == first["recorded_digest"] == status(worker)["digest"]
    assert first["scope"] == "live_weights"
    with torch.no_grad():
        worker.engine.model.weights()["model.norm.weight"].add_(1.0)
    second = ok(worker, "verify_weights")
    assert second["match"] is False and second["recorded_digest"] == first["digest"]
    assert second["digest"] == served_digest(worker)


def test_metrics_expose_the_digest_and_the_epoch(worker: Worker) -> None:
    digest = status(worker)["digest"]
    text = httpx.get(f"{worker.url}/metrics").text
    assert f'weightsync_weight_digest_info{{digest="{digest}"}} 1.0' in text
    assert "weightsync_fleet_epoch" not in text
    ok(worker, "set_weight_version", {"weight_version": "v", "epoch": 5})
    assert "weightsync_fleet_epoch 5.0" in httpx.get(f"{worker.url}/metrics").text
