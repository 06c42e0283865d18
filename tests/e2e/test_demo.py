"""`weightsync demo` end to end: a real worker, checkpoints, disk updates, an async-RL step."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_and_shows_weights_moving() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "demo", "--steps", "2"],
        capture_output=True, text=True, timeout=300, env={"COLUMNS": "200", "PATH": ""},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "version=None version_declared=False" in text
    assert re.search(r"step 1: .*served 'step-1'", text) and re.search(r"step 2: .*served 'step-2'", text)
    assert "[changed]" in text
    assert "corrupt checkpoint refused: HTTP 400 corrupt_checkpoint" in text
    assert "outputs byte-identical after the refused update: True" in text
    assert "saw 2 version span(s)" in text
    assert "final state: version='step-3' paused=False torn=False" in text
