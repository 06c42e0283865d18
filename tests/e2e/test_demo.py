"""`weightsync demo` end to end: a real worker, checkpoints, disk updates, an async-RL step."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# a bare environment, but the same weightsync as this test run imports
_PYTHONPATH = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}


def test_demo_runs_and_shows_weights_moving() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "demo", "--steps", "2"],
        capture_output=True, text=True, timeout=300, env={**_PYTHONPATH, "COLUMNS": "40", "PATH": ""},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "version=None version_declared=False" in text
    # a newcomer is told what they are looking at: the model, the prompt and the target
    assert "starts from random weights" in text
    assert "prompt: 'Q: who moves the weights?\\nA:'" in text
    assert "target: ' weightsync moves them, honestly.'" in text
    assert re.search(r"step 1: .*it now serves 'step-1'", text) and re.search(
        r"step 2: .*it now serves 'step-2'", text
    )
    assert "[changed]" in text
    assert "corrupt checkpoint refused: HTTP 400 corrupt_checkpoint" in text
    assert "outputs byte-identical after the refused update: True" in text
    assert "saw 2 version span(s)" in text
    assert "final state: serving 'step-3', generating, its weights are one whole version" in text
    assert "staged:" not in text and "torn=" not in text
    assert text.rstrip().splitlines()[-1].startswith("Try next:")

    # piped into a narrow pager, a sentence is still one line, never cut mid-phrase
    (intro,) = (line for line in text.splitlines() if line.startswith("The worker runs"))
    assert intro.endswith("taught it something.")
