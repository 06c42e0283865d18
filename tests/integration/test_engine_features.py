"""The serving edge finds an engine's optional features (generation, in-flight requests,
start/close, world size) with ``isinstance`` against core's runtime-checkable protocols, and
serves whatever an engine has: a real loopback server for each engine."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.helpers import TINY
from weightsync.core import Controller
from weightsync.core.engine import (
    ClosingEngine,
    Engine,
    GeneratingEngine,
    ParallelEngine,
    StartingEngine,
    TrackingEngine,
)
from weightsync.core.snapshot import LoadStats, PauseMode, PauseOutcome, WeightInfo
from weightsync.core.sources import WeightSource
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.testing import ScriptableEngine

SRC = Path(__file__).resolve().parents[2] / "src" / "weightsync"


class BareEngine:
    """The Engine protocol and nothing more."""

    name = "bare"

    async def pause(self, mode: PauseMode, clear_cache: bool) -> PauseOutcome:
        return PauseOutcome(aborted=0, cache_cleared=clear_cache)

    async def resume(self) -> None: ...

    async def load_weights(self, source: WeightSource) -> LoadStats:
        return LoadStats(tensors=0, bytes=0, seconds=0.0)

    async def reset_prefix_cache(self) -> None:
        return None

    async def weight_info(self) -> WeightInfo:
        return WeightInfo([])

    async def is_alive(self) -> bool:
        return True

    async def abort_request(self, request_id: str) -> bool:
        return False


def test_the_protocols_name_what_each_engine_has() -> None:
    reference = ReferenceEngine(TINY)
    for feature in (GeneratingEngine, TrackingEngine, StartingEngine, ClosingEngine):
        assert isinstance(reference, feature), feature.__name__
    assert isinstance(reference, ParallelEngine) and reference.world_size == 1  # tensor parallelism: T
    bare = BareEngine()
    assert isinstance(bare, Engine)
    for feature in (GeneratingEngine, TrackingEngine, StartingEngine, ClosingEngine, ParallelEngine):
        assert not isinstance(bare, feature), feature.__name__


def test_an_engine_without_optional_features_serves_the_admin_routes_only() -> None:
    with ServerThread(create_app(Controller(BareEngine()))) as server:
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200 and "in_flight" not in health.json()
        completion = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "hi"},
            headers={"content-type": "application/json"},
        )
        assert completion.status_code == 404
        routes = httpx.get(f"{server.url}/engine/routes").json()
        assert routes["world_size"] == 1 and routes["engine"] == "bare"


def test_an_engine_listing_its_requests_reports_them_and_has_them_aborted_at_shutdown() -> None:
    engine = ScriptableEngine()
    engine.requests.update({"rollout-1", "rollout-2"})
    assert isinstance(engine, TrackingEngine) and engine.in_flight() == ["rollout-1", "rollout-2"]
    server = ServerThread(create_app(Controller(engine))).start()
    try:
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200 and health.json()["in_flight"] == 2
    finally:
        server.stop()
    assert engine.requests == set()
    assert sorted(arg for name, arg in engine.calls if name == "abort_request") == ["rollout-1", "rollout-2"]


def test_the_edge_and_the_kit_probe_no_engine_feature_by_name() -> None:
    probe = re.compile(r"\b(?:hasattr|getattr)\(\s*(?:self\.|controller\.)?engine\b[^)]*\)")
    for rel in ("serve/app.py", "cli.py", "testing/stateful.py"):
        found = [" ".join(m.group().split()) for m in probe.finditer((SRC / rel).read_text())]
        assert found == [], f"{rel} looks up engine features by name: {found}"
