"""docs/embedding.md's example runs as printed and prints what the doc says it prints."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_doc_example

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def test_embedding_example_runs_and_drives_the_controller(tmp_path: Path) -> None:
    out = run_doc_example(DOC, tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line.replace("'", '"').replace("True", "true").replace("False", "false")
                        .replace("None", "null")) for line in out.stdout.splitlines()]  # fmt: skip
    assert lines[0]["version_declared"] is False
    assert lines[1]["status"] == "error" and lines[1]["code"] == "not_paused"
    assert lines[3]["status"] == "ok" and lines[3]["version"] == "step-1"
    assert lines[5] == {"status": "ok", "version": "step-1", "version_declared": True,
                        "paused": False, "torn": False, "update_in_flight": False}  # fmt: skip
