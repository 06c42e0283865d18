"""The README's SGLang-style trainer, run as printed against a real ``weightsync serve`` process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.helpers import WorkerProcess

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.slow


def trainer_script() -> str:
    section = README.read_text().split("## Point an existing trainer at weightsync", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "the README's trainer section has no python block"
    return found.group(1)


def test_the_readmes_sglang_style_trainer_updates_a_worker_as_printed(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(trainer_script())
    worker = WorkerProcess().wait_ready()
    try:
        before = requests.post(f"{worker.url}/engine/get_weight_version", json={}, timeout=60).json()
        env = {**os.environ, "WORKER_URL": worker.url}
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Succeeded to update parameter online." in done.stdout
        assert "'weight_version': 'step-2'" in done.stdout
        after = requests.post(f"{worker.url}/engine/get_weight_version", json={}, timeout=60).json()
        assert after["version"] == "step-2" and not after["paused"] and not after["torn"]
        assert after["digest"] != before["digest"]
    finally:
        worker.stop()
