"""`weightsync serve`: prints its URL, stops cleanly on Ctrl-C, refuses unsafe exposure."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_sigterm_stops_a_paused_worker_with_queued_and_kept_completions_within_seconds() -> None:
    worker = WorkerProcess(model_config="default").wait_ready()  # ~100 tokens/s: requests stay in flight
    try:
        with httpx.Client(base_url=worker.url, headers={"content-type": "application/json"}) as http:
            kept = concurrent.futures.ThreadPoolExecutor(2)
            running = kept.submit(http.post, "/v1/completions", json={"prompt": "kept", "max_tokens": 200},
                                  timeout=60)  # fmt: skip
            deadline = time.monotonic() + 30
            while http.get("/health").json().get("in_flight", 0) < 1:
                assert time.monotonic() < deadline, "the completion never started"
                time.sleep(0.01)
            assert http.post("/engine/pause_generation", json={"mode": "keep"}).status_code == 200
            queued = kept.submit(http.post, "/v1/completions", json={"prompt": "queued"}, timeout=60)
            while http.get("/health").json()["in_flight"] < 2:
                assert time.monotonic() < deadline, "the second completion never queued"
                time.sleep(0.01)
            t0 = time.monotonic()
            worker.proc.send_signal(signal.SIGTERM)
            worker.proc.wait(15)
            took = time.monotonic() - t0
            assert took < 5, f"shutdown took {took:.1f} s"
            # both were answered before the process went, as aborted completions
            for job in (running, queued):
                assert job.result(5).json()["choices"][0]["finish_reason"] == "abort"
            kept.shutdown()
    finally:
        worker.stop()


def test_an_empty_api_key_is_refused_at_start() -> None:
    for args, env in ((["--api-key", ""], {}), ([], {"WEIGHTSYNC_API_KEY": ""})):
        proc = subprocess.run(
            [sys.executable, "-m", "weightsync.cli", "serve", "--port", "1", *args],
            capture_output=True, text=True, timeout=60, env={**os.environ, **env},
        )  # fmt: skip
        assert proc.returncode == 2 and "API key is empty" in proc.stderr, proc.stderr


def test_serve_refuses_a_rebound_host_unless_allowed_with_allowed_host() -> None:
    worker = WorkerProcess("--allowed-host", "worker.internal").wait_ready()
    try:
        for host, status in (("evil.example", 403), ("worker.internal", 200), ("localhost", 200)):
            reply = httpx.post(
                f"{worker.url}/engine/pause_generation", json={}, headers={"host": f"{host}:{worker.port}"}
            )
            assert reply.status_code == status, (host, reply.text)
        assert httpx.get(f"{worker.url}/health", headers={"host": "evil.example"}).status_code == 403
    finally:
        worker.stop()


def test_an_initial_version_that_cannot_be_written_back_is_refused_at_start() -> None:
    for text, message in (
        ('"\\ud800"', "not valid UTF-8"),
        ("[" * 40 + "]" * 40, "levels deep"),
        ("step", "not JSON"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "weightsync.cli", "serve", "--port", "1", "--initial-version", text],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_python_dash_m_weightsync_runs_the_command_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint" in proc.stdout and "serve" in proc.stdout


def test_checkpoint_fills_an_existing_empty_directory_but_not_a_full_one(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    cmd = [sys.executable, "-m", "weightsync.cli", "checkpoint", "--out", str(out), "--model-config", "tiny"]
    made = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(out) and (out / "weightsync-manifest.json").is_file()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "pass --overwrite" in again.stderr
