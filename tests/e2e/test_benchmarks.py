"""Every benchmark script is listed in the README and run by ``make bench`` (vLLM's needs a
GPU: README only), and the fleet benchmark runs from any working directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))


def test_every_benchmark_is_listed_in_the_readme_and_make_bench() -> None:
    readme = set(re.findall(r"benchmarks/(\w+\.py)", (ROOT / "README.md").read_text()))
    bench = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    in_make = set(re.findall(r"benchmarks/(\w+\.py)", bench))
    assert readme >= set(SCRIPTS), set(SCRIPTS) - readme
    assert in_make >= set(SCRIPTS) - {"vllm_update.py"}, set(SCRIPTS) - in_make


def test_the_fleet_benchmark_runs_from_another_directory(tmp_path: Path) -> None:
    args = ["--model-config", "tiny", "--workers", "2", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fleet_update.py"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT ratio_vs_plain_fanout=")
