"""A real `weightsync serve`: hostile updates sent while a rollout runs are refused with a 4xx
and leave the worker serving — not torn, not paused, the rollout untouched, weights identical."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import WorkerProcess
from weightsync.core import errors
from weightsync.engines.reference import CausalLM, ModelConfig
from weightsync.trainer import WorkerClient, save_checkpoint

pytestmark = pytest.mark.slow

NORM = {"name": "model.norm.weight", "dtype": "float32", "shape": [ModelConfig().hidden_size]}
ROLLOUT_TOKENS = 120
UNPAUSED = {"allow_unpaused": True, "reset_prefix_cache": False, "weight_version": "never"}


def _manifest_entry_is_a_string(tmp: Path) -> Path:
    norm = CausalLM(ModelConfig.tiny(hidden_size=ModelConfig().hidden_size)).weights()["model.norm.weight"]
    ckpt = save_checkpoint({"model.norm.weight": norm * 2}, tmp / "ckpt")
    manifest = json.loads((ckpt / "weightsync-manifest.json").read_text())
    manifest["files"][next(iter(manifest["files"]))] = "not an object"
    (ckpt / "weightsync-manifest.json").write_text(json.dumps(manifest))
    return ckpt


HOSTILE: dict[str, Callable[[WorkerClient, Path], Any]] = {
    "shm segment name with a slash": lambda c, _: c.update_weights_from_tensor(
        [{**NORM, "handle": {"shm": "weightsync_a/b", "offset": 0}}], **UNPAUSED
    ),
    "300-character shm segment name": lambda c, _: c.update_weights_from_tensor(
        [{**NORM, "handle": {"shm": "weightsync_" + "x" * 300, "offset": 0}}], **UNPAUSED
    ),
    "NUL byte in model_path": lambda c, tmp: c.update_weights_from_disk(f"{tmp}/a\0b", **UNPAUSED),
    "manifest files entry that is a string": lambda c, tmp: c.update_weights_from_disk(
        str(tmp / "ckpt"), allow_partial=True, **UNPAUSED
    ),
}


def test_hostile_unpaused_updates_are_refused_while_a_rollout_runs_on(tmp_path: Path) -> None:
    worker = WorkerProcess("--allowed-weight-dir", str(tmp_path), model_config="default").wait_ready()
    admin, rollout_client = WorkerClient(worker.url), WorkerClient(worker.url)
    try:
        _manifest_entry_is_a_string(tmp_path)
        admin.set_weight_version("v0")
        before = admin.engine_rpc("weight_hashes")["result"]
        result: dict[str, Any] = {}
        rollout = threading.Thread(
            target=lambda: result.update(rollout_client.complete("rollout", max_tokens=ROLLOUT_TOKENS)),
            daemon=True,
        )
        rollout.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{worker.url}/health").json().get("in_flight") != 1:
            assert time.monotonic() < deadline, "the rollout never started"
            time.sleep(0.01)
        codes = {}
        for case, send in HOSTILE.items():
            with pytest.raises(errors.WeightSyncError) as err:
                send(admin, tmp_path)
            assert 400 <= err.value.http_status < 500, (case, err.value)
            codes[case] = err.value.code
            state = admin.get_weight_version()
            assert (state["torn"], state["paused"], state["version"]) == (False, False, "v0"), (case, state)
        assert httpx.get(f"{worker.url}/health").json()["in_flight"] == 1, "the rollout ended early"
        rollout.join(120)
        assert result["choices"][0]["finish_reason"] == "length", (result, codes)
        assert [s["version"] for s in result["weight_version_spans"]] == ["v0"]
        assert admin.engine_rpc("weight_hashes")["result"] == before
    finally:
        admin.close()
        rollout_client.close()
        worker.stop()
