"""Shared helpers for the test tiers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from weightsync.engines.reference import ModelConfig
from weightsync.transports.hashing import tensor_hashes

if TYPE_CHECKING:
    from weightsync.trainer import WorkerClient

T = TypeVar("T")
S = TypeVar("S", bound="ServedProcess")

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


class ServedProcess:
    """A ``weightsync`` server (``command``: the subcommand, then its arguments) in a
    subprocess on a free loopback port (``--port`` is added), ready once ``/health`` answers
    200.  Its stderr (its log, at INFO by default) goes to an unnamed temporary file, read by
    :meth:`log` and by the error :meth:`wait_ready` raises when the process exits: a pipe
    nobody reads would fill and block the server mid-request.  ``stderr`` sends it elsewhere
    (``subprocess.DEVNULL``) instead.  ``env``: variables set for the process beside this one's."""

    name = "server"

    def __init__(
        self,
        *command: str,
        port: int | None = None,
        stderr: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        import tempfile

        self.env = env
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = command
        self._log = tempfile.TemporaryFile() if stderr is None else None  # noqa: SIM115 - closed by stop
        self._logged = ""
        self.stderr: Any = self._log if stderr is None else stderr
        self.start()

    def log(self) -> str:
        """Everything the process wrote to stderr so far (kept once it is stopped)."""
        if self._log is None or self._log.closed:
            return self._logged
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def start(self) -> None:
        import sys

        sub, *args = self.command
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightsync.cli", sub, "--port", str(self.port), *args],
            stdout=subprocess.DEVNULL, stderr=self.stderr,
            env=None if self.env is None else {**os.environ, **self.env},
        )  # fmt: skip

    def wait_ready(self: S, timeout: float = 60) -> S:
        """Wait until ``/health`` answers 200; raises ``RuntimeError`` if the process exits
        or ``timeout`` passes first."""
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} at {self.url} did not become healthy")

    def stop(self) -> None:
        """Interrupt the process (SIGINT: a clean shutdown), killing it after 20 s."""
        import signal

        stop_process(self.proc, signal.SIGINT, 20)
        if self._log is not None and not self._log.closed:
            self._logged = self.log()
            self._log.close()


class WorkerProcess(ServedProcess):
    """``weightsync serve`` in a subprocess on a free loopback port."""

    name = "worker"

    def __init__(self, *args: str, model_config: str = "tiny") -> None:
        super().__init__("serve", "--model-config", model_config, *args)


class RouterProcess(ServedProcess):
    """``weightsync router`` over ``workers`` in a subprocess on a free loopback port;
    :meth:`wait_ready` waits until ``/health`` says a worker is routable."""

    name = "router"

    def __init__(self, workers: list[str], *args: str) -> None:
        super().__init__("router", *args, *(a for w in workers for a in ("--worker", w)))


@contextlib.contextmanager
def served_workers(n: int, *args: str) -> Iterator[list[WorkerProcess]]:
    """``n`` ready ``weightsync serve`` processes (``args`` for each), stopped on exit."""
    procs = [WorkerProcess(*args) for _ in range(n)]
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.stop()


@contextlib.contextmanager
def paused_clients(workers: list[WorkerProcess], version: Any = None) -> Iterator[list[WorkerClient]]:
    """A client per worker, each worker healthy and paused first (a torn or running one is
    paused with ``abort``) and, with ``version``, declaring it; closed on exit."""
    from weightsync.trainer import WorkerClient

    cs = [WorkerClient(w.url) for w in workers]
    try:
        for c in cs:
            state = c.get_weight_version()
            if state["torn"] or not state["paused"]:
                c.pause_generation("abort")
            if version is not None:
                c.set_weight_version(version)
        yield cs
    finally:
        for c in cs:
            c.close()


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


def vllm_weight_source(tensors: dict[str, torch.Tensor]) -> Any:
    """vLLM's ``WeightSource`` over ``tensors`` (names, dtypes and shapes, then the tensors), for
    vLLM's own trainer flow."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Weights(WeightSource):  # type: ignore[misc]
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(tensors.items())

    return Weights()


def stop_process(proc: subprocess.Popen[Any], sig: int, grace_s: float) -> None:
    """Send ``sig`` to ``proc`` if it still runs, and kill it if it has not exited after
    ``grace_s`` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


GREEDY_PROMPT = "The weights changed:"


def greedy(url: str, prompt: str = GREEDY_PROMPT) -> list[int]:
    """The token ids a worker at ``url`` answers ``prompt`` with, greedily (8 tokens)."""
    import requests

    r = requests.post(
        f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def fresh_output(tmp_path: Path, weights: dict[str, torch.Tensor]) -> list[int]:
    """What a fresh reference engine loaded with ``weights`` answers greedily (:func:`greedy`)."""
    import requests

    from weightsync.core import Controller
    from weightsync.engines.reference import ReferenceEngine
    from weightsync.serve import ServerThread, create_app
    from weightsync.trainer import save_checkpoint

    path = save_checkpoint(weights, tmp_path / "fresh")
    engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path])
    with ServerThread(create_app(Controller(engine, paused=True))) as server:
        r = requests.post(
            f"{server.url}/engine/update_weights_from_disk", json={"model_path": str(path)}, timeout=60
        )
        assert r.status_code == 200, r.text
        requests.post(f"{server.url}/engine/resume_generation", json={}, timeout=60)
        return greedy(server.url)
