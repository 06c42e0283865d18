"""Every benchmark script is listed in the README and run by ``make bench`` (vLLM's, ``vllm_*.py``:
README only), the fleet benchmark runs from any working directory, the broadcast benchmark
measures both of its baselines and exits, and the rollout benchmark's small run measures every
path (the reference engine's everywhere, vLLM's where vLLM is installed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))


def test_every_benchmark_is_listed_in_the_readme_and_make_bench() -> None:
    readme = set(re.findall(r"benchmarks/(\w+\.py)", (ROOT / "README.md").read_text()))
    bench = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    in_make = set(re.findall(r"benchmarks/(\w+\.py)", bench))
    assert readme >= set(SCRIPTS), set(SCRIPTS) - readme
    vllm = {s for s in SCRIPTS if s.startswith("vllm_")}  # they start a vLLM: README only
    assert in_make >= set(SCRIPTS) - vllm, set(SCRIPTS) - in_make


def test_the_fleet_benchmark_runs_from_another_directory(tmp_path: Path) -> None:
    args = ["--model-config", "tiny", "--workers", "2", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fleet_update.py"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT ratio_vs_plain_fanout=")


@pytest.mark.slow
def test_the_broadcast_benchmark_measures_both_baselines_and_exits(tmp_path: Path) -> None:
    # Its per-tensor baseline must join a group the worker accepts a bare stream on.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "broadcast.py"), "--model-config", "tiny", "--repeats", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    found = re.fullmatch(r"RESULT ratio_vs_flat=(\S+) ratio_vs_per_tensor_rpc=(\S+)", last)
    assert found is not None, last
    assert all(float(x) > 0 for x in found.groups()), last  # nan (a step failed) is not > 0


ROLLOUT = r"RESULT ratio_worker_vs_engine=(\S+) ratio_router_vs_engine=(\S+) ratio_vllm_vs_vllm_server=(\S+)"


def run_rollout(tmp_path: Path, *args: str, timeout: float) -> tuple[float, ...]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rollout.py"), "--quick", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    found = re.fullmatch(ROLLOUT, last)
    assert found is not None, last
    return tuple(float(x) for x in found.groups())


@pytest.mark.slow
def test_the_rollout_benchmark_measures_the_worker_and_the_router_against_the_engine(tmp_path: Path) -> None:
    x, y, z = run_rollout(tmp_path, "--no-vllm", timeout=280)
    assert x > 0 and y > 0 and z != z, (x, y, z)  # vLLM left out: nan


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_the_rollout_benchmark_measures_vllm_against_its_own_server(tmp_path: Path) -> None:
    assert all(r > 0 for r in run_rollout(tmp_path, timeout=1750))
