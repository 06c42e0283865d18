"""docs/ray.md's example runs as printed on a local Ray cluster and prints what the doc says
it prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import run_doc_example

pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")

DOC = Path(__file__).resolve().parents[2] / "docs" / "ray.md"


@pytest.mark.slow
def test_the_ray_example_runs_and_prints_what_the_doc_shows(tmp_path: Path) -> None:
    printed = re.search(r"It prints.*?```\n(.*?)```", DOC.read_text(), re.S)
    assert printed, "docs/ray.md shows no output of its example"
    out = run_doc_example(DOC, tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == printed.group(1)
