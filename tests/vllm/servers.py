"""vLLM servers for the vLLM tests: ``weightsync serve --engine vllm`` and vLLM's own
OpenAI-compatible server, each on a free loopback port with its log in a file (a pipe nobody
drains would fill and block the server), ready once ``/health`` answers.

Every start costs ~25 s and ~2.5 GB here: a module starts its server once (module-scoped
fixtures); two lanes of modules run at once (``tests/parallel.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

from tests.helpers import free_port

MEMORY = "0.05"
"""The share of host memory a test's vLLM reserves for its KV cache (~1.2 GB here: ample for a
tiny model and 512 tokens; a larger share costs seconds of every start, and two lanes of vLLM
tests run at once)."""

VLLM_ARGS = [
    "skip_tokenizer_init=true",
    "dtype=float32",
    "max_model_len=512",
    f"gpu_memory_utilization={MEMORY}",
]
"""The engine arguments of every vLLM the tests start (``--vllm-arg`` of ``weightsync serve``)."""

SERVER_ARGS = [
    "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", MEMORY,
    "--max-model-len", "512",
]  # fmt: skip
"""The same arguments for vLLM's own server."""

START_TIMEOUT_S = 1200.0
"""How long a start may take: a loaded machine starts vLLM slowly."""


class VllmProcess:
    """A server process on ``port`` (``argv`` already names it), its stdout discarded and its
    stderr written to ``log``; :meth:`stop` sends ``stop_signal``, then kills after 30 s."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        log: Path,
        *,
        env: dict[str, str] | None = None,
        stop_signal: int = signal.SIGTERM,
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.stop_signal = stop_signal
        self._log: IO[bytes] = log.open("wb")
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=self._log, env={**os.environ, **(env or {})}
        )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> VllmProcess:
        """Wait until ``/health`` answers 200 (the process is stopped if it never does)."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                assert self.proc.poll() is None, f"the server exited: {self.log_tail()}"
                try:
                    if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"the server did not start: {self.log_tail()}"
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def vllm_worker(
    model: Path,
    root: Path,
    *args: str,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    vllm_args: Sequence[str] = (),
) -> VllmProcess:
    """``weightsync serve --engine vllm`` on ``model``, loading checkpoints from ``root``, with
    ``args`` added to its flags and ``env`` to its environment; started and ready (its log:
    ``log``, by default beside the model).  ``vllm_args``: more ``--vllm-arg`` values, after
    (so over) :data:`VLLM_ARGS`."""
    port = free_port()
    argv = [sys.executable, "-m", "weightsync.cli", "serve", "--port", str(port), "--engine", "vllm",
            "--model", str(model), "--allowed-weight-dir", str(root), *args]  # fmt: skip
    for a in (*VLLM_ARGS, *vllm_args):
        argv += ["--vllm-arg", a]
    log = log or model.with_name(f"{model.name}-worker-{port}.log")
    return VllmProcess(argv, port, log, env=env, stop_signal=signal.SIGINT).wait_ready()


def vllm_server(
    model: Path, *args: str, log: Path, env: dict[str, str] | None = None, tokenizer: bool = False
) -> VllmProcess:
    """vLLM's own OpenAI-compatible server on ``model`` with ``args`` added; started and ready.
    ``tokenizer``: with the tokenizer beside the model (text prompts and chat), not without."""
    port = free_port()
    server_args = [a for a in SERVER_ARGS if a != "--skip-tokenizer-init"] if tokenizer else SERVER_ARGS
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), *server_args, *args]  # fmt: skip
    return VllmProcess(argv, port, log, env=env).wait_ready()


_Held = TypeVar("_Held")


@contextlib.contextmanager
def held(served: _Held) -> Iterator[_Held]:
    """A module's served worker (an object with ``client`` and ``worker``): its client closed
    and its process stopped when the module is done, however it ends."""
    try:
        yield served
    finally:
        s: Any = served
        s.client.close()
        s.worker.stop()
