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
import pytest

from tests.helpers import WorkerProcess


def test_serve_prints_url_serves_and_stops_cleanly_on_ctrl_c() -> None:
    worker = WorkerProcess().wait_ready()
    try:
        assert httpx.post(f"{worker.url}/engine/liveness_probe", json={}).json()["alive"] is True
        worker.proc.send_signal(signal.SIGINT)
        # a graceful shutdown, then the exit status a shell expects after Ctrl-C
        assert worker.proc.wait(30) in (0, 130, -signal.SIGINT)
        assert "Traceback" not in worker.log()
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
        ("[" * 5000 + "]" * 5000, "nested too deeply"),
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


def _serve_once(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "serve", "--model-config", "tiny", *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def test_serve_announces_the_port_it_really_bound() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync.cli", "serve", "--port", "0", "--model-config", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().rsplit(" ", 1)[-1].strip()
        port = int(url.rsplit(":", 1)[1])
        assert port != 0
        # announced only once bound and started: the address answers at once
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


def test_serve_on_a_busy_port_exits_2_with_a_one_line_error() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _serve_once("--port", str(port))
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "already in use" in lines[0] and str(port) in lines[0], done.stderr


def test_serve_refuses_an_api_key_no_http_client_can_send() -> None:
    for key in ("clé-secrète", "tab\tkey", " padded "):
        done = _serve_once("--port", "0", "--api-key", key)
        assert done.returncode == 2, key
        assert "printable ASCII" in done.stderr and "Traceback" not in done.stderr


def test_serve_engine_vllm_without_vllm_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from weightsync.cli import main\n"
        "raise SystemExit(main(['serve', '--engine', 'vllm', '--port', '0']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "pip install '.[http,torch,vllm]'" in done.stderr


def test_every_command_help_has_a_line_per_flag_and_shows_defaults() -> None:
    import argparse

    from weightsync.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}")
            elif action.option_strings and action.dest != "help":
                assert action.help, f"{path} {action.option_strings[0]} has no help line"
        parser.format_help()  # renders: every default can be shown

    walk(build_parser(), "weightsync")
    text = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "(default: 8000)" in text and "(default: 127.0.0.1)" in text and "(default: reference)" in text
    # a secret in the environment is never printed as a default
    env = {**os.environ, "WEIGHTSYNC_API_KEY": "s3cret-token"}
    text = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "serve", "--help"], capture_output=True, text=True, env=env,
        timeout=60,
    ).stdout  # fmt: skip
    assert "s3cret-token" not in text
    fleet = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "fleet", "status", "--help"], capture_output=True, text=True,
        env=env, timeout=60,
    ).stdout  # fmt: skip
    assert "--api-key" in fleet and "s3cret-token" not in fleet


def test_serve_refuses_a_tensor_parallel_size_that_does_not_split_the_model() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "serve", "--port", "0", "--model-config", "tiny",
         "--tensor-parallel-size", "3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (
        done.returncode == 2 and "does not divide num_heads" in done.stderr and "Traceback" not in done.stderr
    )


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_tensor_parallel_serve_answers_and_stops_every_rank_on_sigterm_within_seconds() -> None:
    worker = WorkerProcess("--tensor-parallel-size", "2").wait_ready(120)
    try:
        with httpx.Client(base_url=worker.url, headers={"content-type": "application/json"}) as http:
            assert http.get("/engine/routes").json()["world_size"] == 2
            reply = http.post("/v1/completions", json={"prompt": "two ranks", "max_tokens": 5}, timeout=60)
            assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 5
        ranks = _children(worker.proc.pid)
        assert ranks and all(_running(p) for p in ranks)
        t0 = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        worker.proc.wait(15)
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 5
        while any(_running(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(p) for p in ranks), "a tensor-parallel rank outlived the server"
    finally:
        worker.stop()


def test_version_prints_the_packages_version() -> None:
    from weightsync import __version__

    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == f"weightsync {__version__}"
