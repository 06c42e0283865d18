"""Fuzz the served OpenAPI surface: bodies drawn from the published schemas, junk, and
hostile shapes (deep nesting, lone surrogates, NaN/Infinity, huge integers, odd dtypes and
segment names).  No reply may be a 5xx (501 "not supported" aside), every reply is a JSON
object with a status, and the server lives."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.workers import Worker
from weightsync.serve.schemas import BODIES, COMPLETION, documented
from weightsync.testing import json_values
from weightsync.testing.strategies import (
    deep_json_texts,
    from_schema,
    hostile_json,
    hostile_values,
    huge_ints,
    lone_surrogates,
    non_finite,
    odd_tensor_handles,
)

# init_weights_update_group would dial master_address: its fields are unit-tested instead.
FUZZED = sorted(set(BODIES) - {"init_weights_update_group"})
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_worker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.helpers import TINY
    from weightsync.core import Controller
    from weightsync.engines.reference import ReferenceEngine
    from weightsync.serve import ServerThread, create_app
    from weightsync.trainer import save_checkpoint

    root = tmp_path_factory.mktemp("fuzz")
    engine = ReferenceEngine(TINY, allowed_weight_dirs=[root])
    save_checkpoint(engine.model.weights(), root / "initial")  # to refill weights fuzzing discarded
    with (
        ServerThread(create_app(Controller(engine))) as server,
        httpx.Client(base_url=server.url, headers={"content-type": "application/json"}) as http,
    ):
        http.initial_checkpoint = str(root / "initial")  # type: ignore[attr-defined]
        yield http


def serving(http: httpx.Client) -> None:
    """Bring a worker that earlier fuzzing left paused, in a session, or with its memory
    released (discarded weights come back only through an update) back to serving."""
    abort = http.post("/engine/abort_weight_update", json={})
    assert abort.status_code in (200, 409), abort.text
    http.post("/engine/pause_generation", json={})
    http.post("/engine/resume_memory", json={})
    if http.post("/engine/get_weight_version", json={}).json()["weights_released"]:
        path = http.initial_checkpoint  # type: ignore[attr-defined]
        refill = http.post("/engine/update_weights_from_disk", json={"model_path": path})
        assert refill.status_code == 200, refill.text
    assert http.post("/engine/resume_generation", json={}).status_code == 200


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
        # the same schema with field descriptions; OpenAPI publishes numeric bounds as floats
        assert published["schema"] == json.loads(json.dumps(documented(schema)), parse_int=float)


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
    # a stream answers events, not one JSON object (tests/integration/test_generation.py)
    body.pop("stream", None)
    serving(fuzz_worker)  # earlier fuzzing may have paused it, opened a session, released memory
    check(fuzz_worker.post("/v1/completions", content=json.dumps(body)))


# ----------------------------------------------------------------------------- hostile shapes


def still_answers(http: httpx.Client) -> None:
    assert http.post("/engine/get_weight_version", json={}).status_code == 200
    assert http.post("/engine/resume_generation", json={}).status_code in (200, 409)
    if not http.post("/engine/get_weight_version", json={}).json()["paused"]:
        done = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1})
        assert done.status_code == 200, done.text


@FUZZ
@given(route=st.sampled_from(FUZZED), data=st.data())
def test_a_hostile_value_in_any_field_never_5xx(
    fuzz_worker: httpx.Client, route: str, data: st.DataObject
) -> None:
    body = data.draw(from_schema(BODIES[route]))
    fields = sorted(BODIES[route]["properties"]) or ["weight_version"]
    body[data.draw(st.sampled_from(fields))] = data.draw(hostile_values())
    check(fuzz_worker.post(f"/engine/{route}", content=hostile_json(body)))
    still_answers(fuzz_worker)


@FUZZ
@given(version=hostile_values())
def test_a_hostile_version_is_refused_or_read_back_unchanged(fuzz_worker: httpx.Client, version: Any) -> None:
    reply = fuzz_worker.post("/engine/set_weight_version", content=hostile_json({"weight_version": version}))
    check(reply)
    if reply.status_code == 200:
        assert fuzz_worker.post("/engine/get_weight_version", json={}).json()["version"] == version
    else:
        # NaN / Infinity are not JSON (invalid_json); the rest cannot be written back (invalid_value)
        assert reply.status_code == 400 and reply.json()["code"] in ("invalid_value", "invalid_json")
    still_answers(fuzz_worker)


@FUZZ
@given(path=st.sampled_from([*(f"/engine/{r}" for r in FUZZED), "/v1/completions"]), raw=deep_json_texts)
def test_json_nested_beyond_any_stack_is_400(fuzz_worker: httpx.Client, path: str, raw: bytes) -> None:
    reply = fuzz_worker.post(path, content=raw)
    check(reply)
    assert reply.status_code == 400


@FUZZ
@given(
    prompt=st.one_of(lone_surrogates, st.lists(huge_ints, min_size=1, max_size=2)),
    seed=huge_ints | non_finite,
)
def test_hostile_completion_fields_are_400(fuzz_worker: httpx.Client, prompt: Any, seed: Any) -> None:
    serving(fuzz_worker)
    for body in ({"prompt": prompt, "max_tokens": 1}, {"prompt": "x", "max_tokens": 1, "seed": seed}):
        reply = fuzz_worker.post("/v1/completions", content=hostile_json(body))
        check(reply)
        assert reply.status_code == 400, body


@FUZZ
@given(tensors=st.lists(odd_tensor_handles(), min_size=1, max_size=3), version=json_values(max_leaves=2))
def test_odd_dtypes_and_segment_names_are_refused_without_tearing(
    fuzz_worker: httpx.Client, tensors: list[dict[str, Any]], version: Any
) -> None:
    assert fuzz_worker.post("/engine/pause_generation", json={}).status_code == 200
    before = fuzz_worker.post("/engine/get_weight_version", json={}).json()
    body = {"tensors": tensors, "weight_version": version}
    reply = fuzz_worker.post("/engine/update_weights_from_tensor", content=hostile_json(body))
    check(reply)
    assert 400 <= reply.status_code < 500, reply.text  # no such segment holds weights: never a load
    after = fuzz_worker.post("/engine/get_weight_version", json={}).json()
    assert after == before and not after["torn"]
