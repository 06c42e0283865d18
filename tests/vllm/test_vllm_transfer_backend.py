"""The engine-side ``weightsync`` backend inside vLLM's own server: vLLM picks it by name
(``--weight-transfer-config '{"backend": "weightsync"}'``) from its factory in each worker,
and vLLM's own RL routes (dev mode) drive it, with vLLM's trainer flow and the trainer-side
``weightsync`` backend on the other end of a gloo group."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import requests
import torch

from tests.vllm.servers import vllm_server
from tests.vllm.test_server_middleware import vllm_completion
from tests.vllm.tiny_llama import TinyLlamas
from weightsync.transports.hashing import tensor_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], list(range(40, 80))]  # each under one cache block


class Server:
    def __init__(self, models: TinyLlamas) -> None:
        self.a, self.b = models.a, models.b
        self.a_tensors, self.b_tensors = models.a_tensors, models.b_tensors
        self.proc = vllm_server(
            self.a,
            "--weight-transfer-config", json.dumps({"backend": "weightsync"}),
            "--worker-extension-cls", "weightsync.engines.vllm.transfer_extension.WeightSyncTransferExtension",
            log=models.root / "transfer-backend-server.log", env={"VLLM_SERVER_DEV_MODE": "1"},
        )  # fmt: skip
        self.url = self.proc.url

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
        self.proc.stop()


@pytest.fixture(scope="module")
def server(tiny_llamas: TinyLlamas) -> Iterator[Server]:
    s = Server(tiny_llamas)
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
