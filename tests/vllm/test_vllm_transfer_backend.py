"""The engine-side ``weightsync`` backend inside vLLM's own server: vLLM picks it by name
(``--weight-transfer-config '{"backend": "weightsync"}'``) from its factory in each worker,
and vLLM's own RL routes (dev mode) drive it, with vLLM's trainer flow and the trainer-side
``weightsync`` backend on the other end of a gloo group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import requests
import torch
from safetensors.torch import load_file

from tests.helpers import free_port
from tests.vllm.test_server_middleware import vllm_completion
from weightsync.transports.hashing import tensor_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], list(range(40, 80))]  # each under one cache block


class Server:
    def __init__(self, root: Path) -> None:
        from tests.vllm.tiny_llama import make_tiny_llama

        self.a, self.b = make_tiny_llama(root / "a", seed=1), make_tiny_llama(root / "b", seed=2)
        self.a_tensors = load_file(str(self.a / "model.safetensors"))
        self.b_tensors = load_file(str(self.b / "model.safetensors"))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = root / "server.log"
        self._log = self.log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.a),
             "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
             "--gpu-memory-utilization", "0.25", "--max-model-len", "512",
             "--weight-transfer-config", json.dumps({"backend": "weightsync"}),
             "--worker-extension-cls",
             "weightsync.engines.vllm.transfer_extension.WeightSyncTransferExtension"],
            stdout=subprocess.DEVNULL, stderr=self._log,
            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
        )  # fmt: skip
        try:
            self._wait_ready(deadline=time.monotonic() + 1200)  # slow on a loaded machine
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, deadline: float) -> None:
        while True:
            assert self.proc.poll() is None, f"vLLM server exited: {self.log_tail()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"vLLM server did not start: {self.log_tail()}"
            time.sleep(0.5)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def outputs(self) -> list[list[int]]:
        return [vllm_completion(self.url, p) for p in PROMPTS]

    def transfer_engine(self) -> dict[str, object]:
        r = requests.post(
            f"{self.url}/collective_rpc", json={"method": "weightsync_transfer_engine"}, timeout=60
        )
        assert r.status_code == 200, r.text
        (result,) = r.json()["results"]
        assert isinstance(result, dict)
        return result

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("vllm-backend"))
    try:
        yield s
    finally:
        s.stop()


def test_vllm_builds_the_weightsync_backend_by_name_and_updates_land_through_it(server: Server) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from weightsync.trainer.vllm_backend import WeightSyncTrainerInitInfo, register

    class Weights(WeightSource):
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.tensors = tensors

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(self.tensors.items())

    url = server.url
    assert server.transfer_engine() == {"engine": "WeightSyncWeightTransferEngine", "received": {}}
    a_outputs = server.outputs()
    register()
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0,
                                  bucket_bytes=256 * 1024, timeout_s=300),
        client=HTTPVLLMWeightSyncClient(url, timeout=120),
        source=Weights(server.b_tensors),
    )  # fmt: skip
    try:
        assert requests.post(f"{url}/pause?mode=abort", timeout=60).status_code == 200
        engine.send_weights()  # vLLM's own start/update/finish routes, into the backend
        r = requests.post(f"{url}/update_weight_version", json={"new_version": "b"}, timeout=60)
        assert r.status_code == 200, r.text
        assert requests.post(f"{url}/resume", timeout=60).status_code == 200
        assert server.transfer_engine()["received"] == tensor_hashes(server.b_tensors.items())
        assert requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"] == "b"
        b_outputs = server.outputs()
        assert b_outputs != a_outputs
        # A second round on the same group puts a back: vLLM answers exactly as at start.
        requests.post(f"{url}/pause?mode=abort", timeout=60)
        engine.source = Weights(server.a_tensors)
        engine.send_weights()
        requests.post(f"{url}/resume", timeout=60)
        assert server.transfer_engine()["received"] == tensor_hashes(server.a_tensors.items())
        assert server.outputs() == a_outputs
    finally:
        engine.shutdown()


def test_importing_the_extension_registers_the_backend_where_vllm_looks_it_up() -> None:
    # In a process of its own: the extension's module starts the worker watchdog.
    code = (
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\n"
        "assert 'weightsync' not in F._registry\n"
        "import weightsync.engines.vllm.transfer_extension\n"
        "print(F._registry['weightsync']().__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "WeightSyncWeightTransferEngine"
