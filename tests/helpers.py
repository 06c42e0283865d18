"""Shared helpers for the test tiers."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import torch

from weightsync.engines.reference import ModelConfig
from weightsync.transports.hashing import tensor_hashes

T = TypeVar("T")

TINY = ModelConfig.tiny()


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def hashes(engine: Any) -> dict[str, str]:
    return tensor_hashes(engine.model.weights().items())


def perturbed(
    weights: dict[str, torch.Tensor], seed: int = 1, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """New weights of the same names and shapes (what a trainer step produces)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.02
        out[name] = (t.float() + noise).to(dtype or t.dtype).contiguous()
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerProcess:
    """``weightsync serve`` in a subprocess on a free loopback port."""

    def __init__(self, *args: str, model_config: str = "tiny") -> None:
        import subprocess
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightsync.cli", "serve", "--port", str(self.port),
             "--model-config", model_config, *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 60) -> WorkerProcess:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"worker exited: {self.proc.stderr.read().decode() if self.proc.stderr else ''}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("worker did not start")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


class RouterProcess:
    """``weightsync router`` over ``workers`` in a subprocess on a free loopback port."""

    def __init__(self, workers: list[str], *args: str) -> None:
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "weightsync.cli", "router", "--port", str(self.port), *args]
        for w in workers:
            cmd += ["--worker", w]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self, timeout: float = 60) -> RouterProcess:
        """Wait until ``/health`` says a worker is routable; raises ``RuntimeError`` if not."""
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"router exited: {self.proc.stderr.read().decode() if self.proc.stderr else ''}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("router did not become healthy")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def run_doc_example(doc: Path, tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the first ```python block of ``doc`` as a script; return the finished process."""
    import re
    import sys

    code = re.search(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert code, f"{doc.name} has no python example"
    script = tmp_path / "example.py"
    script.write_text(code.group(1))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout)


def rss_anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakAnonMemory:
    """``with PeakAnonMemory() as peak: ...`` then ``peak.extra``: the most anonymous memory
    the block added, sampled every ``interval`` seconds from another thread."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval

    def __enter__(self) -> PeakAnonMemory:
        import threading

        self.base = self.peak = rss_anon_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        import time

        while not self._done.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.base
