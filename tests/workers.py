"""In-process loopback workers for the integration and hostile tiers: the `make_worker` and
`worker` fixtures (registered in tests/conftest.py) and the `Worker` they hand out."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.helpers import TINY
from weightsync.core import Controller
from weightsync.engines.reference import ModelConfig, ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import WorkerClient


@attrs.define
class Worker:
    server: ServerThread
    client: WorkerClient
    engine: ReferenceEngine
    controller: Controller
    root: Path

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture
def make_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def make(config: ModelConfig = TINY, *, api_key: str | None = None, **app_kwargs: Any) -> Worker:
        root = tmp_path / f"ckpts{len(started)}"
        root.mkdir()
        engine = ReferenceEngine(config, allowed_weight_dirs=[root])
        controller = Controller(engine)
        server = ServerThread(create_app(controller, api_key=api_key, **app_kwargs)).start()
        worker = Worker(server, WorkerClient(server.url, api_key=api_key), engine, controller, root)
        started.append(worker)
        return worker

    yield make
    for w in started:
        w.client.close()
        w.server.stop()


@pytest.fixture
def worker(make_worker: Callable[..., Worker]) -> Worker:
    return make_worker()
