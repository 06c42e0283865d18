"""Fuzz the served OpenAPI surface: bodies drawn from the published schemas, and junk.
No reply may be a 5xx (501 "not supported" aside), every reply is a JSON object with a status, and the server lives."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.transports.conftest import Worker
from weightsync.testing import json_values
from weightsync.testing.strategies import from_schema
from weightsync.transports.http.schemas import BODIES, COMPLETION

# init_weights_update_group would dial master_address: its fields are unit-tested instead.
FUZZED = sorted(set(BODIES) - {"init_weights_update_group"})
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_worker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.helpers import TINY
    from weightsync.core import Controller
    from weightsync.engines.reference import ReferenceEngine
    from weightsync.transports.http import ServerThread, create_app

    root = tmp_path_factory.mktemp("fuzz")
    engine = ReferenceEngine(TINY, allowed_weight_dirs=[root])
    with (
        ServerThread(create_app(Controller(engine))) as server,
        httpx.Client(base_url=server.url, headers={"content-type": "application/json"}) as http,
    ):
        yield http


def check(reply: httpx.Response) -> None:
    # 501 is the honest "this engine does not do that"; any other 5xx is a defect.
    assert reply.status_code < 500 or reply.status_code == 501, reply.text
    body = reply.json()
    assert (isinstance(body, dict) and body.get("status") in ("ok", "error")) or "choices" in body
    if reply.status_code >= 400:
        assert body["status"] == "error" and body["code"] and body["message"]


def test_openapi_spec_publishes_every_route_schema(fuzz_worker: Worker) -> None:
    spec = fuzz_worker.get("/openapi.json").json()
    for name, schema in BODIES.items():
        published = spec["paths"][f"/engine/{name}"]["post"]["requestBody"]["content"]["application/json"]
        assert published["schema"] == schema


@pytest.mark.parametrize("route", FUZZED)
def test_schema_valid_bodies_never_5xx(fuzz_worker: httpx.Client, route: str) -> None:
    @FUZZ
    @given(body=from_schema(BODIES[route]))
    def fuzz(body: Any) -> None:
        check(fuzz_worker.post(f"/engine/{route}", content=json.dumps(body)))

    fuzz()
    assert fuzz_worker.get("/health").json()["alive"]


@FUZZ
@given(route=st.sampled_from(FUZZED), body=json_values(max_leaves=8))
def test_arbitrary_json_never_5xx(fuzz_worker: httpx.Client, route: str, body: Any) -> None:
    check(fuzz_worker.post(f"/engine/{route}", content=json.dumps(body)))


@FUZZ
@given(route=st.sampled_from(FUZZED), raw=st.binary(max_size=64))
def test_arbitrary_bytes_never_5xx(fuzz_worker: httpx.Client, route: str, raw: bytes) -> None:
    check(fuzz_worker.post(f"/engine/{route}", content=raw))


@FUZZ
@given(body=from_schema(COMPLETION).map(lambda b: {**b, "max_tokens": min(b.get("max_tokens", 4), 4)}))
def test_completion_bodies_never_5xx(fuzz_worker: httpx.Client, body: dict[str, Any]) -> None:
    body.pop("request_id", None)
    # earlier fuzzing may have paused the worker, and completions queue while paused
    assert fuzz_worker.post("/engine/resume_generation", json={}).status_code == 200
    check(fuzz_worker.post("/v1/completions", content=json.dumps(body)))
