"""A reference-engine worker on a real loopback server, for the dialect tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import requests

from tests.helpers import TINY, hashes
from weightsync.core import Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app


@attrs.define
class Served:
    url: str
    engine: ReferenceEngine
    controller: Controller
    root: Path

    def post(self, path: str, json: Any = None, **kw: Any) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=json, timeout=60, **kw)

    def get(self, path: str) -> requests.Response:
        return requests.get(f"{self.url}{path}", timeout=60)

    def state(self) -> tuple[Any, ...]:
        snap = self.controller.snapshot()
        return (
            snap.version,
            snap.generation,
            snap.digest,
            snap.commits,
            tuple(sorted(hashes(self.engine).items())),
        )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path])
    controller = Controller(engine)
    with ServerThread(create_app(controller)) as server:
        yield Served(server.url, engine, controller, tmp_path)
