"""A reference-engine worker on a real loopback server, launched the way SGLang's tests launch
a server on a model, for tests/peers/test_sglang_*.py.

SGLang's server starts on a model path, which ``/get_model_info`` reports and SGLang's tests
post back to ``/update_weights_from_disk``.  The reference engine starts on seeded weights,
not a path, so :func:`launch` saves them as a checkpoint and loads it once through SGLang's
own ``/update_weights_from_disk``: from then on ``model_path`` is that checkpoint's path.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
import requests
import torch

from tests.helpers import TINY, free_port
from tests.peers.sglang_calls import init_custom_process_group
from weightsync.core import UNDECLARED, Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import save_checkpoint

PROMPT = "The capital of France is"


@attrs.define
class SglangWorker:
    url: str
    engine: ReferenceEngine
    controller: Controller
    root: Path
    model_path: str
    """The checkpoint it was launched on."""

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(f"{self.url}{path}", timeout=120, **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=json, timeout=120, **kw)

    def decode(self, max_tokens: int = 32, **extra: Any) -> dict[str, Any]:
        """A greedy completion of :data:`PROMPT` (SGLang's tests' ``run_decode``)."""
        r = self.post(
            "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    def tokens(self) -> list[int]:
        return list(self.decode()["choices"][0]["token_ids"])

    def other_model(self, name: str, seed: int) -> str:
        """A checkpoint of other weights (SGLang's tests load the base model beside the
        instruct one): every tensor moved by half its own spread, so greedy outputs change."""
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for key, t in self.engine.model.weights().items():
            noise = torch.randn(t.shape, generator=gen) * (t.float().std().item() or 1.0) * 0.5
            weights[key] = (t.float() + noise).to(t.dtype).contiguous()
        return str(save_checkpoint(weights, self.root / name))


def launch(root: Path, *, version: Any = UNDECLARED) -> Iterator[SglangWorker]:
    """A running worker launched on a checkpoint of its own seeded weights (module docstring)."""
    engine = ReferenceEngine(TINY, allowed_weight_dirs=[root])
    controller = Controller(engine, version=version)
    path = str(save_checkpoint(engine.model.weights(), root / "launch"))
    with ServerThread(create_app(controller)) as server:
        r = requests.post(f"{server.url}/update_weights_from_disk", json={"model_path": path}, timeout=120)
        assert r.status_code == 200 and r.json()["success"], r.text
        yield SglangWorker(server.url, engine, controller, root, path)


@pytest.fixture
def sglang_worker(tmp_path: Path) -> Iterator[SglangWorker]:
    yield from launch(tmp_path)


def rank0_beside(group_name: str, join: Callable[[int], None]) -> Any:
    """Trainer rank 0 of a two-rank gloo group on a fresh port, formed with SGLang's own
    ``init_custom_process_group`` while ``join(port)`` has the worker join as rank 1 (it asserts
    the worker's reply); returns rank 0's process group once both are in."""
    port = free_port()
    timeout = datetime.timedelta(seconds=60)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(
            init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, group_name, timeout
        )
        join(port)
        return joining.result(timeout=60)
