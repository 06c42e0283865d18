"""Long checkpoint writes report their progress: to a callback, and on the CLI's stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightsync.trainer import save_checkpoint

pytestmark = pytest.mark.unit


def test_save_checkpoint_reports_progress_up_to_the_total(tmp_path: Path) -> None:
    weights = {f"w{i}": torch.randn(64, 64) for i in range(6)}
    seen: list[tuple[int, int, str]] = []
    save_checkpoint(
        weights, tmp_path / "ckpt", shard_bytes=2 * 64 * 64 * 4, progress=lambda *a: seen.append(a)
    )
    total = 3 * sum(t.numel() * t.element_size() for t in weights.values())
    done = [d for d, _, _ in seen]
    assert done == sorted(done) and done[-1] == total
    assert {t for _, t, _ in seen} == {total}
    # every shard is named while it is written
    assert sum(what.startswith("writing model-") for _, _, what in seen) == 3


def test_checkpoint_command_prints_progress_on_stderr_and_only_the_path_on_stdout(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "checkpoint", "--model-config", "tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("weightsync checkpoint: 100% (")
