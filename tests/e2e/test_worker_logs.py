"""A real `weightsync serve --log-level info` says what it does: every pause, update, refusal,
resume and declaration is one line on stderr, as text or (``--log-format json``) one JSON
object a line carrying the event's fields — uvicorn's own lines included."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import WorkerProcess
from weightsync.core import errors
from weightsync.engines.reference import CausalLM, ModelConfig
from weightsync.trainer import WorkerClient, save_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _drive(tmp: Path, *serve_args: str) -> tuple[str, str]:
    """Declare, refuse an unpaused update, pause, update, resume; return (checkpoint digest
    as the worker reported it, the worker's stderr)."""
    weights = CausalLM(ModelConfig.tiny()).weights()
    ckpt = save_checkpoint({k: v * 2 for k, v in weights.items()}, tmp / "ckpt")
    worker = WorkerProcess("--log-level", "info", *serve_args).wait_ready()
    try:
        with WorkerClient(worker.url) as c:
            c.set_weight_version("v0", epoch=1)
            with pytest.raises(errors.IllegalState) as refused:
                c.update_weights_from_disk(str(ckpt), weight_version="step-1")
            assert refused.value.code == "not_paused"
            c.pause_generation("abort")
            digest = c.update_weights_from_disk(str(ckpt), weight_version="step-1")["digest"]
            c.resume_generation()
        worker.proc.send_signal(signal.SIGINT)
        worker.proc.wait(timeout=30)
    finally:
        worker.stop()
    return digest, worker.log()


def _events(stderr: str) -> dict[str, dict[str, Any]]:
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]  # every line is JSON
    for line in lines:
        assert {"ts", "level", "logger", "message"} <= line.keys(), line
    return {line["event"]: line for line in lines if line["logger"] == "weightsync.events"}


def test_json_log_lines_carry_every_state_change_and_its_fields(tmp_path: Path) -> None:
    digest, stderr = _drive(tmp_path, "--log-format", "json")
    events = _events(stderr)
    assert events["declare"]["version"] == "v0" and events["declare"]["epoch"] == 1
    refused = events["refused"]
    assert refused["code"] == "not_paused" and refused["route"] == "update_weights_from_disk"
    assert refused["message"] and refused["status"] == 409
    pause = events["pause"]
    assert pause["mode"] == "abort" and pause["aborted"] == 0 and pause["kept"] is False
    update = events["update"]
    assert update["source"] == "disk" and update["version"] == "step-1"
    assert update["tensors"] == len(CausalLM(ModelConfig.tiny()).weights())
    assert update["bytes"] > 0 and update["ms"] >= 0 and isinstance(update["staged"], bool)
    assert update["digest"] == digest
    assert events["resume"]["level"] == "INFO"
    assert all(e["level"] == "INFO" for e in events.values())
    uvicorn_lines = [line for line in stderr.splitlines() if '"logger": "uvicorn.error"' in line]
    assert uvicorn_lines, "uvicorn's own start-up lines are JSON too"


def test_text_log_lines_name_each_event_with_its_fields(tmp_path: Path) -> None:
    digest, stderr = _drive(tmp_path)
    mine = [line for line in stderr.splitlines() if " weightsync.events: " in line]
    said = {line.split("weightsync.events: ")[1].split()[0]: line for line in mine}
    assert {"declare", "refused", "pause", "update", "resume"} <= said.keys(), stderr
    assert "code='not_paused'" in said["refused"] and "INFO" in said["refused"]
    assert "mode='abort'" in said["pause"] and "aborted=0" in said["pause"]
    assert "source='disk'" in said["update"] and f"digest={digest!r}" in said["update"]
    assert not stderr.lstrip().startswith("{")


def test_serve_with_default_flags_logs_an_update_at_info(tmp_path: Path) -> None:
    """Failed on the old code: the default level was warning, so a newcomer saw nothing."""
    weights = CausalLM(ModelConfig.tiny()).weights()
    ckpt = save_checkpoint({k: v * 2 for k, v in weights.items()}, tmp_path / "ckpt")
    worker = WorkerProcess().wait_ready()
    try:
        with WorkerClient(worker.url) as c:
            c.pause_generation("abort")
            c.update_weights_from_disk(str(ckpt), weight_version="step-1")
            c.resume_generation()
        worker.proc.send_signal(signal.SIGINT)
        worker.proc.wait(timeout=30)
    finally:
        worker.stop()
    err = worker.log()
    said = [line for line in err.splitlines() if " weightsync.events: " in line]
    assert any("update " in line and "version='step-1'" in line for line in said), err
    assert any(" pause " in f" {line.split('weightsync.events: ')[1]}" for line in said)
    assert "POST /engine/" not in err  # no access line per request at info
