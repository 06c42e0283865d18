"""The README's five-minute tour, run command by command exactly as printed.

The only change is the port (8000 → a free one), so the test can run beside anything.
The second block runs in a fresh temporary directory, as a newcomer's shell would.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.helpers import free_port

README = Path(__file__).resolve().parents[2] / "README.md"
VENV_BIN = Path(sys.executable).parent


def tour_blocks() -> list[str]:
    section = README.read_text().split("## Five-minute tour", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, blank lines dropped."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_tour_has_a_serve_block_and_a_block_of_client_commands() -> None:
    blocks = tour_blocks()
    assert len(blocks) == 2, blocks
    assert commands(blocks[0]) == ["weightsync serve --model-config tiny --port 8000"]
    assert "/abs/path" not in blocks[1]
    for command in commands(blocks[1]):
        if command.startswith("curl"):
            assert "-sS --fail-with-body" in command and "Content-Type: application/json" in command, command


def test_readme_tour_runs_as_printed_to_a_successful_update(tmp_path: Path) -> None:
    port = str(free_port())
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    serve, client = (block.replace("8000", port) for block in tour_blocks())
    worker = subprocess.Popen(
        shlex.split(commands(serve)[0]), cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert worker.poll() is None, worker.stderr.read().decode() if worker.stderr else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "worker did not start"
                time.sleep(0.2)
        replies = []
        for command in commands(client):
            out = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
            )
            assert out.returncode == 0, (command, out.stdout, out.stderr)
            replies.append(out.stdout)
    finally:
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            if worker.stderr is not None:
                worker.stderr.close()
    assert Path(replies[0].strip()) == tmp_path / "ckpt-step-1"
    first, before, _, update, _, last, after = (json.loads(r) for r in replies[1:])
    assert first["version_declared"] is False and first["version"] is None
    assert update["status"] == "ok" and update["version"] == "step-1"
    assert last["version"] == "step-1" and last["version_declared"] is True and last["paused"] is False
    assert before["choices"][0]["text"] != after["choices"][0]["text"], "the update changed nothing"
