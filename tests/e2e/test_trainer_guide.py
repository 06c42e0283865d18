"""docs/trainer-guide.md's loop runs as printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer-guide.md"


def test_trainer_guide_loop_runs(tmp_path: Path) -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert code
    script = tmp_path / "loop.py"
    script.write_text(code.group(1))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("1 step-1") and lines[1].startswith("2 step-2")
    assert "'step-4'" in lines[2]
    assert "'version': 'step-4'" in lines[3] and "'torn': False" in lines[3]
