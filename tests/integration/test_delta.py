"""Delta updates on a real loopback worker: exact base, all or nothing, verified, and the same
digest and outputs as a worker that loaded the target in full."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.delta_helpers import Worker, base_weights, changed, delta_worker, write_delta
from tests.helpers import fresh_output, greedy
from weightsync.trainer import save_checkpoint
from weightsync.trainer.digest import weights_digest
from weightsync.transports.delta.manifest import DeltaManifest
from weightsync.transports.hashing import tensor_hashes


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    with delta_worker(tmp_path) as w:
        yield w


def test_delta_takes_a_worker_to_the_digest_and_outputs_of_the_target(worker: Worker, tmp_path: Path) -> None:
    base = base_weights()
    target = changed(base, 0.01)
    path = write_delta(base, target, tmp_path / "a-to-b")
    assert worker.state()["digest"] == weights_digest(base)
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 200, r.text
    stats = r.json()["stats"]["delta"]
    assert stats["target_digest"] == weights_digest(target)
    assert 0 < stats["elements_changed"] <= sum(max(1, t.numel() // 100) for t in base.values())
    state = worker.state()
    assert (state["version"], state["torn"]) == ("B", False)
    assert state["digest"] == weights_digest(target)  # what a worker that loaded B in full reports
    assert worker.held() == tensor_hashes(target.items())  # and the bytes it serves are B's
    worker.post("resume_generation")
    assert greedy(worker.url) == fresh_output(tmp_path, target)


def test_xor_delta_reaches_the_same_target(worker: Worker, tmp_path: Path) -> None:
    base = base_weights()
    target = changed(base, 0.05, seed=3)
    path = write_delta(base, target, tmp_path / "xor", encoding="xor")
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 200, r.text
    assert r.json()["stats"]["delta"]["encoding"] == "xor"
    assert worker.held() == tensor_hashes(target.items())
    assert worker.state()["digest"] == weights_digest(target)


def test_a_worker_already_on_the_target_refuses_the_delta_and_changes_nothing(
    worker: Worker, tmp_path: Path
) -> None:
    base = base_weights()
    target = changed(base)
    path = write_delta(base, target, tmp_path / "a-to-b")
    assert (
        worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B").status_code == 200
    )
    held = worker.held()
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="C")
    assert r.status_code == 409, r.text
    assert r.json()["code"] == "base_mismatch"
    # It says it is on the delta's target (new: "it holds digest T, the delta applies to A").
    assert "already holds the delta's target, version 'B'" in r.json()["message"], r.text
    assert r.json()["details"]["target_digest"] == weights_digest(target)
    state = worker.state()
    assert (state["version"], state["torn"], state["digest"]) == ("B", False, weights_digest(target))
    assert worker.held() == held


def test_a_relative_delta_path_is_refused_by_its_own_name(worker: Worker) -> None:
    """Failed on the previous code: a relative ``delta_path`` was refused as a relative
    ``model_path``, a field the request did not have."""
    r = worker.post("update_weights_from_delta", delta_path="a-to-b", dry_run=True)
    assert r.status_code == 400 and r.json()["code"] == "invalid_value", r.text
    assert r.json()["message"].startswith("delta_path must be absolute") and "model_path" not in r.text


def test_a_delta_given_as_a_full_checkpoint_is_refused_as_a_delta_naming_the_delta_route(
    worker: Worker, tmp_path: Path
) -> None:
    """Failed on the previous code: ``update_weights_from_disk`` of a delta directory was
    ``unknown_tensor`` (the payload's indices and values), which names neither what the path
    is nor what to do with it."""
    base = base_weights()
    path = write_delta(base, changed(base), tmp_path / "a-to-b")
    for dry_run in (True, False):
        r = worker.post("update_weights_from_disk", model_path=str(path), dry_run=dry_run)
        assert r.status_code == 400 and r.json()["code"] == "is_a_delta", r.text
        assert "update_weights_from_delta" in r.json()["message"] and "--from-delta" in r.json()["message"]
    assert worker.held() == tensor_hashes(base.items()) and worker.state()["torn"] is False


def test_weights_changed_behind_its_back_refuse_the_delta(worker: Worker, tmp_path: Path) -> None:
    """The label still says "A" (a load without a version keeps it), but the bytes are not A's."""
    base = base_weights()
    other = changed(base, 0.001, seed=99)
    ckpt = save_checkpoint(other, tmp_path / "other")
    assert worker.post("update_weights_from_disk", model_path=str(ckpt)).status_code == 200
    path = write_delta(base, changed(base), tmp_path / "a-to-b")
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 409 and r.json()["code"] == "base_mismatch", r.text
    assert r.json()["details"]["held_digest"] == weights_digest(other)
    assert worker.held() == tensor_hashes(other.items())
    assert worker.state()["torn"] is False


def test_a_declared_version_other_than_the_base_is_refused(worker: Worker, tmp_path: Path) -> None:
    base = base_weights()
    path = write_delta(base, changed(base), tmp_path / "d", base_version="not-A")
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 409 and r.json()["code"] == "base_mismatch", r.text
    assert worker.held() == tensor_hashes(base.items())


def _wrong_value_in_second_tensor(manifest: DeltaManifest, payload: dict[str, torch.Tensor]) -> None:
    """A value of the second changed tensor that does not make the target (the payload's
    checksums are written for it, so only the check after the write can tell): found after
    the first changed tensor was written."""
    entry = max(manifest.changed[1:], key=lambda t: t.numel)  # the largest one written after another
    values = payload[entry.values or ""]
    values[0] = values[0] + 1.0


@pytest.mark.parametrize(("fraction", "check"), [(0.001, "linear"), (0.05, "rehash")])
def test_a_failure_midway_is_undone_and_leaves_the_worker_exactly_on_its_base(
    worker: Worker, tmp_path: Path, fraction: float, check: str
) -> None:
    """Either check finds it: the linear move for a sparse change, one xxh3 pass for a dense one."""
    base = base_weights()
    path = write_delta(base, changed(base, fraction), tmp_path / "d", edit=_wrong_value_in_second_tensor)
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["code"] == "delta_unverified" and body["details"]["undone"] is True
    assert f"({check})" in body["message"]
    state = worker.state()
    assert (state["version"], state["torn"], state["digest"]) == ("A", False, weights_digest(base))
    assert worker.held() == tensor_hashes(base.items())  # every byte back, not just the label


def test_an_undo_that_cannot_be_proven_tears_the_worker(
    worker: Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore is made to fail (a fault injected into this process): the worker must say
    torn, not claim it is on its base."""
    import weightsync.transports.delta.apply as apply_mod

    monkeypatch.setattr(apply_mod, "_restore", lambda written, fault: False)
    base = base_weights()
    path = write_delta(base, changed(base), tmp_path / "d", edit=_wrong_value_in_second_tensor)
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="B")
    assert r.status_code == 500 and r.json()["code"] == "weights_torn", r.text
    state = worker.state()
    assert state["torn"] is True and state["digest"] is None
    assert worker.post("resume_generation").status_code == 409


def test_dry_run_checks_the_base_and_predicts_the_target_digest(worker: Worker, tmp_path: Path) -> None:
    base = base_weights()
    target = changed(base)
    path = write_delta(base, target, tmp_path / "d")
    r = worker.post("update_weights_from_delta", delta_path=str(path), dry_run=True)
    assert r.status_code == 200, r.text
    assert r.json()["digest"] == weights_digest(target)
    assert worker.held() == tensor_hashes(base.items())


@pytest.mark.slow
def test_weightsync_delta_cli_writes_a_delta_between_two_checkpoints(worker: Worker, tmp_path: Path) -> None:
    base = base_weights()
    target = changed(base)
    a = save_checkpoint(base, tmp_path / "a", version="A")
    b = save_checkpoint(target, tmp_path / "b", version="B")
    out = tmp_path / "a-to-b"
    done = subprocess.run(
        [sys.executable, "-m", "weightsync", "delta", "--base", str(a), "--target", str(b), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == out
    r = worker.post("update_weights_from_delta", delta_path=str(out))
    assert r.status_code == 200, r.text
    state = worker.state()
    assert state["digest"] == weights_digest(target)
    assert state["version"] == "A"  # no weight_version given: the label follows the omitted-version rule
    again = subprocess.run(
        [sys.executable, "-m", "weightsync", "delta", "--base", str(a), "--target", str(b), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert again.returncode == 2 and "exists" in again.stderr


def test_delta_trainer_chains_committed_deltas_and_refuses_an_uncommitted_base(
    worker: Worker, tmp_path: Path
) -> None:
    from weightsync.trainer.delta import DeltaTrainer

    a = base_weights()
    deltas = DeltaTrainer(a, version="A")
    assert deltas.base_digest == worker.state()["digest"]
    b = changed(a, 0.01, seed=1)
    p1 = deltas.write(b, tmp_path / "1", version="B")
    with pytest.raises(RuntimeError, match="never committed"):
        deltas.write(changed(b, 0.01, seed=2), tmp_path / "x", version="C")
    assert worker.post("update_weights_from_delta", delta_path=str(p1), weight_version="B").status_code == 200
    deltas.committed()
    c = changed(b, 0.01, seed=2)
    p2 = deltas.write(c, tmp_path / "2", version="C")
    assert worker.post("update_weights_from_delta", delta_path=str(p2), weight_version="C").status_code == 200
    assert worker.held() == tensor_hashes(c.items())
    assert worker.state()["digest"] == weights_digest(c)
    deltas.abandoned()  # say the fleet rolled C back: the next delta builds on B again
    assert deltas.base_version == "B"


def test_a_delta_that_changes_nothing_relabels_and_keeps_the_bytes(worker: Worker, tmp_path: Path) -> None:
    base = base_weights()
    path = write_delta(base, base, tmp_path / "noop", target_version="A2")
    r = worker.post("update_weights_from_delta", delta_path=str(path), weight_version="A2")
    assert r.status_code == 200, r.text
    assert r.json()["stats"]["delta"]["elements_changed"] == 0
    state = worker.state()
    assert (state["version"], state["digest"]) == ("A2", weights_digest(base))
    assert worker.held() == tensor_hashes(base.items())
