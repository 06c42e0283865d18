"""The README's fleet example ("A fleet of two"), run command by command as printed, in a
fresh directory.

The only change is the ports (8001 and 8002 → free ones), so the test can run beside anything.
A command ending in ``&`` is started in the background, as the shell would; every other one
runs to completion in ``bash`` and must succeed.  What the example claims is checked from
outside: ``checkpoint --initial`` wrote exactly what the fresh workers held (the transaction's
rollback source), both workers serve ``step-1`` at epoch 1 with the digest of the checkpoint's
own bytes, and ``fleet status --journal`` lists them on it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from safetensors.torch import load_file

from tests.helpers import free_port
from weightsync.core.held import weights_digest
from weightsync.transports.hashing import tensor_hashes

README = Path(__file__).resolve().parents[2] / "README.md"
VENV_BIN = Path(sys.executable).parent


def fleet_commands() -> list[str]:
    section = README.read_text().split("## A fleet of two", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def digest_of(checkpoint: Path) -> str:
    loaded = {}
    for shard in checkpoint.glob("*.safetensors"):
        loaded.update(load_file(str(shard)))
    return weights_digest(tensor_hashes(loaded.items()))


def state(port: str) -> dict[str, object]:
    r = httpx.post(f"http://127.0.0.1:{port}/engine/get_weight_version", json={}, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_the_fleet_example_starts_two_workers_and_names_its_rollback_source() -> None:
    commands = fleet_commands()
    assert [c for c in commands if c.endswith("&")] == [
        "weightsync serve --model-config tiny --port 8001 &",
        "weightsync serve --model-config tiny --port 8002 &",
    ]
    assert "weightsync checkpoint --model-config tiny --initial --out ckpt-step-0" in commands
    (update,) = [c for c in commands if c.startswith("weightsync fleet update")]
    assert '--initial-source "$PWD/ckpt-step-0"' in update and "/abs/" not in update


def test_the_readme_fleet_example_runs_as_printed_to_a_committed_transaction(tmp_path: Path) -> None:
    ports = {"8001": str(free_port()), "8002": str(free_port())}
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    workers: list[subprocess.Popen[bytes]] = []
    held_before: dict[str, object] = {}
    outputs: dict[str, str] = {}
    try:
        for printed in fleet_commands():
            command = printed
            for old, new in ports.items():
                command = command.replace(old, new)
            if command.endswith("&"):
                workers.append(
                    subprocess.Popen(shlex.split(command[:-1]), cwd=tmp_path, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )  # fmt: skip
                continue
            if command.startswith("weightsync fleet update"):  # what the fresh workers hold
                held_before = {port: state(port)["digest"] for port in ports.values()}
            out = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
            )
            assert out.returncode == 0, (printed, out.stdout[-2000:], out.stderr[-2000:])
            outputs[printed] = out.stdout
        after = {port: state(port) for port in ports.values()}
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGINT)
        for worker in workers:
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    initial = digest_of(tmp_path / "ckpt-step-0")
    assert held_before == dict.fromkeys(ports.values(), initial)  # --initial wrote what they held
    step1 = digest_of(tmp_path / "ckpt-step-1")
    assert {port: (s["version"], s["epoch"], s["digest"], s["paused"]) for port, s in after.items()} == {
        port: ("step-1", 1, step1, False) for port in ports.values()
    }
    (status,) = [out for command, out in outputs.items() if command.startswith("weightsync fleet status")]
    for port in ports.values():
        assert re.search(rf"localhost:{port}\b.*step-1", status), status
