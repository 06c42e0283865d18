"""docs/trainer-guide.md's loop runs as printed."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import run_doc_example

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer-guide.md"


def test_trainer_guide_loop_runs(tmp_path: Path) -> None:
    out = run_doc_example(DOC, tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("1 step-1") and lines[1].startswith("2 step-2")
    assert "'step-4'" in lines[2]
    assert "'version': 'step-4'" in lines[3] and "'torn': False" in lines[3]
