"""docs/embedding.md's example runs as printed and prints what the doc says it prints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def test_embedding_example_runs_and_drives_the_controller(tmp_path: Path) -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert code
    script = tmp_path / "embed.py"
    script.write_text(code.group(1))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line.replace("'", '"').replace("True", "true").replace("False", "false")
                        .replace("None", "null")) for line in out.stdout.splitlines()]  # fmt: skip
    assert lines[0]["version_declared"] is False
    assert lines[1]["status"] == "error" and lines[1]["code"] == "not_paused"
    assert lines[3]["status"] == "ok" and lines[3]["version"] == "step-1"
    assert lines[5] == {"status": "ok", "version": "step-1", "version_declared": True,
                        "paused": False, "torn": False, "update_in_flight": False}  # fmt: skip
