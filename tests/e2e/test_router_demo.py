"""``weightsync router-demo`` runs as printed: a rolling update under load fails no request."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_router_demo_rolls_the_fleet_forward_while_every_request_succeeds() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "router-demo", "--steps", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "rolling update to step-1, max_unavailable=1" in out
    assert " 0 failed" in out
    assert out.count("routable, version 'step-1', epoch 1") == 3, out
    for state in ("draining", "updating", "routable"):
        assert f": {state} (" in out, state
