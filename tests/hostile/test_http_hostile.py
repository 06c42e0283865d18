"""Hostile input at the HTTP edge, on real loopback servers over the reference engine:
versions that cannot be written back, values that used to be 500s, and cross-site requests.
Each refusal is a 4xx with a precise code, changes nothing, and leaves the worker answering."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.helpers import TINY, hashes
from tests.workers import Worker
from weightsync.core import Controller, errors
from weightsync.engines.reference import ReferenceEngine
from weightsync.serve import create_app

JSON = {"content-type": "application/json"}


def post(worker: Worker, path: str, raw: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{worker.url}{path}", content=raw, headers=JSON if headers is None else headers, timeout=30
    )


def still_answers(worker: Worker) -> None:
    """get_weight_version and a completion both answer 200 with a readable version."""
    version = httpx.post(f"{worker.url}/engine/get_weight_version", json={}, timeout=30)
    assert version.status_code == 200, version.text
    done = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert done.status_code == 200, done.text
    assert done.json()["weight_version"] == version.json()["version"]


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


# Raw JSON text, so a lone surrogate reaches the server exactly as an attacker sends it.
BAD_VERSIONS = {
    "lone surrogate": r'"\ud800"',
    "lone surrogate inside a list": r'["ok", "\udfff"]',
    "lone surrogate as a key": r'{"\ud800": 1}',
    "33 levels deep": json.dumps(nested(33)),
    "500 levels deep": json.dumps(nested(500)),
    "over 64 KiB": json.dumps("x" * (64 << 10)),
    "number out of float range": "1e400",
}


@pytest.mark.parametrize("version", BAD_VERSIONS.values(), ids=BAD_VERSIONS.keys())
def test_a_version_that_cannot_be_written_back_is_refused_and_the_worker_still_answers(
    worker: Worker, version: str
) -> None:
    worker.client.set_weight_version("v0")
    reply = post(worker, "/engine/set_weight_version", b'{"weight_version": %s}' % version.encode())
    assert reply.status_code == 400 and reply.json()["code"] == "invalid_value", reply.text
    assert reply.json()["details"]["field"] == "weight_version"
    assert worker.client.get_weight_version()["version"] == "v0"
    still_answers(worker)


@pytest.mark.parametrize("version", BAD_VERSIONS.values(), ids=BAD_VERSIONS.keys())
def test_every_update_route_refuses_such_a_version_before_looking_at_the_state(
    worker: Worker, version: str
) -> None:
    bodies = {  # the worker is running: a valid body would be 409 not_paused
        "update_weights_from_disk": {"model_path": str(worker.root)},
        "update_weights_from_distributed": {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                            "shapes": [[64]], "group_name": "g"},
        "update_weights_from_tensor": {"tensors": [{"name": "model.norm.weight", "dtype": "float32",
                                                    "shape": [64], "handle": {"shm": "weightsync_x", "offset": 0}}]},
    }  # fmt: skip
    weights = hashes(worker.engine)
    for route, body in bodies.items():
        raw = json.dumps(body)[:-1] + ', "weight_version": ' + version + "}"
        reply = post(worker, f"/engine/{route}", raw.encode())
        assert reply.status_code == 400 and reply.json()["code"] == "invalid_value", (route, reply.text)
    assert hashes(worker.engine) == weights
    still_answers(worker)


def test_a_version_at_the_depth_limit_is_served_and_stamped(worker: Worker) -> None:
    deep = nested(32)
    assert worker.client.set_weight_version(deep)["version"] == deep
    assert worker.client.get_weight_version()["version"] == deep
    assert worker.client.complete("x", max_tokens=2)["weight_version_spans"][0]["version"] == deep
    text = {"k€y": "välue ✓"}  # non-ASCII that is valid UTF-8 is fine
    worker.client.set_weight_version(text)
    assert worker.client.complete("x", max_tokens=2)["weight_version"] == text


# ----------------------------------------------------------------------------- former 500s


@pytest.mark.parametrize("timeout", ["1e300", "1e400", "-1", "0", "86401"])
def test_an_unusable_rendezvous_timeout_is_400(worker: Worker, timeout: str) -> None:
    fields = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
              "group_name": "g", "backend": "gloo"}  # fmt: skip
    body = json.dumps(fields)[:-1] + f', "timeout_s": {timeout}}}'
    reply = post(worker, "/engine/init_weights_update_group", body.encode())
    assert reply.status_code == 400 and reply.json()["code"] == "invalid_value", reply.text
    assert reply.json()["details"]["field"] == "timeout_s"


@pytest.mark.parametrize(
    ("body", "field"),
    [(b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
     (b'{"prompt": "x", "seed": -9223372036854775809}', "seed"),
     (b'{"prompt": "a\\ud800b"}', "prompt")],
)  # fmt: skip
def test_an_out_of_range_seed_or_a_surrogate_prompt_is_400(worker: Worker, body: bytes, field: str) -> None:
    reply = post(worker, "/v1/completions", body)
    assert reply.status_code == 400 and reply.json()["code"] == "invalid_value", reply.text
    assert reply.json()["details"]["field"] == field
    assert (
        worker.client.complete("x", max_tokens=2, seed=2**63 - 1)["choices"][0]["finish_reason"] == "length"
    )


@pytest.mark.parametrize(
    "path", ["/engine/set_weight_version", "/engine/pause_generation", "/v1/completions"]
)
def test_a_body_nested_100k_deep_is_400_too_deep(worker: Worker, path: str) -> None:
    reply = post(worker, path, b"[" * 100_000 + b"]" * 100_000)
    assert reply.status_code == 400 and reply.json()["code"] == "too_deep", reply.text
    assert not worker.client.get_weight_version()["paused"]
    still_answers(worker)


def test_an_unknown_field_named_with_a_lone_surrogate_is_a_readable_400(worker: Worker) -> None:
    reply = post(worker, "/engine/pause_generation", rb'{"\ud800": true}')
    assert reply.status_code == 400 and reply.json()["code"] == "unknown_field"
    assert reply.json()["details"]["fields"] == ["\ud800"]


def test_an_empty_api_key_is_refused_when_the_app_is_built() -> None:
    with pytest.raises(errors.InvalidRequest) as err:
        create_app(Controller(ReferenceEngine(TINY)), api_key="")
    assert err.value.code == "empty_api_key"


# ----------------------------------------------------------------------------- cross-site

SIMPLE_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]


@pytest.mark.parametrize("content_type", SIMPLE_TYPES)
def test_a_cross_site_simple_post_cannot_pause_the_worker(worker: Worker, content_type: str) -> None:
    # What a page on another site can send without a preflight: no JSON type, a foreign Origin.
    headers = {"content-type": content_type, "origin": "https://evil.example"}
    reply = post(worker, "/engine/pause_generation", b'{"mode": "abort"}', headers)
    assert reply.status_code == 403 and reply.json()["code"] == "forbidden_origin"
    # Without Origin (an old browser, a plugin) the type alone is refused.
    reply = post(worker, "/engine/pause_generation", b'{"mode": "abort"}', {"content-type": content_type})
    assert reply.status_code == 415 and reply.json()["code"] == "unsupported_media_type"
    assert worker.client.get_weight_version()["paused"] is False


@pytest.mark.parametrize("path", ["/engine/resume_generation", "/engine/liveness_probe", "/v1/completions"])
def test_every_post_needs_the_json_content_type_even_without_a_body(worker: Worker, path: str) -> None:
    reply = httpx.post(f"{worker.url}{path}")
    assert reply.status_code == 415 and reply.json()["code"] == "unsupported_media_type"
    assert post(worker, path, b'{"prompt": "x", "max_tokens": 1}' if "v1" in path else b"").status_code == 200


def test_a_foreign_origin_is_403_even_with_a_json_body(worker: Worker) -> None:
    for origin in ("http://evil.example", "null", f"{worker.url}.evil.example", "http://localhost:1"):
        reply = post(
            worker, "/engine/set_weight_version", b'{"weight_version": "x"}', {**JSON, "origin": origin}
        )
        assert reply.status_code == 403 and reply.json()["code"] == "forbidden_origin", origin
    assert worker.client.get_weight_version()["version_declared"] is False
    own = post(
        worker, "/engine/set_weight_version", b'{"weight_version": "mine"}', {**JSON, "origin": worker.url}
    )
    assert own.status_code == 200 and worker.client.get_weight_version()["version"] == "mine"


def test_a_rebound_host_name_is_403_on_every_route(worker: Worker) -> None:
    port = worker.server.port
    rebound = {"host": f"evil.example:{port}"}
    reply = post(
        worker,
        "/engine/pause_generation",
        b"{}",
        {**JSON, **rebound, "origin": f"http://evil.example:{port}"},
    )
    assert reply.status_code == 403 and reply.json()["code"] == "forbidden_host"
    for path in ("/health", "/metrics", "/engine/routes", "/openapi.json"):
        reply = httpx.get(f"{worker.url}{path}", headers=rebound)
        assert reply.status_code == 403 and reply.json()["code"] == "forbidden_host", path
    assert worker.client.get_weight_version()["paused"] is False


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST"])
def test_loopback_host_names_are_served_with_or_without_a_port(worker: Worker, host: str) -> None:
    for name in (host, f"{host}:{worker.server.port}"):
        assert httpx.get(f"{worker.url}/health", headers={"host": name}).status_code == 200
        reply = post(worker, "/engine/liveness_probe", b"{}", {**JSON, "host": name})
        assert reply.status_code == 200, (name, reply.text)


def test_get_routes_need_no_content_type(worker: Worker) -> None:
    for path in ("/health", "/metrics", "/engine/routes", "/docs"):
        assert httpx.get(f"{worker.url}{path}").status_code == 200, path


def test_allowed_hosts_admit_a_configured_name(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(allowed_hosts=["worker.internal"])
    ok = post(worker, "/engine/pause_generation", b"{}", {**JSON, "host": "worker.internal:8000"})
    assert ok.status_code == 200 and worker.client.get_weight_version()["paused"] is True
    other = post(worker, "/engine/resume_generation", b"{}", {**JSON, "host": "other.internal"})
    assert other.status_code == 403 and other.json()["code"] == "forbidden_host"
    anyone = make_worker(allowed_hosts=["*"])
    assert httpx.get(f"{anyone.url}/health", headers={"host": "other.internal"}).status_code == 200


def test_the_clients_send_json_and_map_the_new_refusals(worker: Worker) -> None:
    # every typed-client call passes the guard (json= sets the type), bodiless routes included
    assert worker.client.resume_generation()["status"] == "ok"
    assert worker.client.liveness_probe()["alive"] is True
    worker.client.http.headers["origin"] = "http://evil.example"
    with pytest.raises(errors.Forbidden) as err:
        worker.client.pause_generation()
    assert err.value.code == "forbidden_origin"
