"""The README's five-minute tour, run command by command exactly as printed.

The only change is the port (8000 → a free one), so the test can run beside anything.
The second block runs in a fresh temporary directory, as a newcomer's shell would.  The last
completion asks for logprobs: they are checked against a direct forward of the checkpoint the
tour wrote, and its stamps against the version the tour declared.
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
import torch
from safetensors.torch import load_file

from tests.helpers import TINY, free_port
from weightsync.engines.reference.model import CausalLM

README = Path(__file__).resolve().parents[2] / "README.md"
VENV_BIN = Path(sys.executable).parent
LOGPROB_TOL = 1e-4


def direct_logprobs(checkpoint: Path, tokens: list[int]) -> torch.Tensor:
    """``log_softmax`` of a forward of ``tokens`` by the checkpoint's weights: [T, V]."""
    model = CausalLM(TINY, slots=1)
    loaded: dict[str, torch.Tensor] = {}
    for f in checkpoint.glob("*.safetensors"):
        loaded.update(load_file(str(f)))
    with torch.no_grad():
        for name, p in model.weights().items():
            p.copy_(loaded[name])
        return torch.log_softmax(model.forward_full(torch.tensor([tokens]))[0].float(), -1)


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
    (choice,) = after["choices"]
    # Stamped with the version the tour declared, one span over every token.
    assert (after["weight_version"], after["weight_version_declared"], after["weight_version_current"]) == (
        "step-1",
        True,
        True,
    )
    tokens = choice["token_ids"]
    assert len(tokens) == 8 and choice["weight_version"] == "step-1"
    assert [{k: v for k, v in s.items() if k != "digest"} for s in choice["weight_version_spans"]] == [
        {
            "version": "step-1",
            "version_declared": True,
            "first_token": 0,
            "last_token": 7,
            "version_current": True,
            "epoch": None,  # a worker outside a fleet: no fleet epoch
        }
    ]
    # The logprob of every sampled token, the raw distribution of the checkpoint's weights.
    prompt = list(b"hello")
    lp = direct_logprobs(tmp_path / "ckpt-step-1", prompt + tokens)
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 8
    for i, (token, value, top) in enumerate(
        zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    ):
        expected = lp[len(prompt) + i - 1]
        assert abs(value - float(expected[token])) < LOGPROB_TOL
        assert token == int(expected.argmax())  # greedy: the sampled token is the likeliest
        assert list(top.values()) == [value]
