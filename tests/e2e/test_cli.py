"""`weightsync serve`: prints its URL, stops cleanly on Ctrl-C, refuses unsafe exposure."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx

from tests.helpers import WorkerProcess


def test_serve_prints_url_serves_and_stops_cleanly_on_ctrl_c() -> None:
    worker = WorkerProcess().wait_ready()
    try:
        assert httpx.post(f"{worker.url}/engine/liveness_probe", json={}).json()["alive"] is True
        worker.proc.send_signal(signal.SIGINT)
        # a graceful shutdown, then the exit status a shell expects after Ctrl-C
        assert worker.proc.wait(30) in (0, 130, -signal.SIGINT)
        assert worker.proc.stderr is not None
        assert "Traceback" not in worker.proc.stderr.read().decode()
    finally:
        worker.stop()


def test_serve_prints_its_url() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync.cli", "serve", "--port", "0", "--model-config", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert line.startswith("weightsync worker (reference) serving on http://127.0.0.1:")


def test_binding_beyond_loopback_needs_a_key_and_allowed_dirs() -> None:
    base = [sys.executable, "-m", "weightsync.cli", "serve", "--host", "0.0.0.0", "--port", "1"]
    no_key = subprocess.run(base, capture_output=True, text=True, timeout=60, env={"PATH": ""})
    assert no_key.returncode == 2 and "API key is required" in no_key.stderr
    no_dir = subprocess.run([*base, "--api-key", "k"], capture_output=True, text=True, timeout=60)
    assert no_dir.returncode == 2 and "--allowed-weight-dir is required" in no_dir.stderr
