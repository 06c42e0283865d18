"""Everything that lists admin routes derives from the one registry, ``core.routes.ROUTES``:
a route added there is served, documented, has a client method (sync, async and fleet)
whose parameters are its body's fields, and is a metrics series."""

from __future__ import annotations

import inspect
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.helpers import perturbed
from tests.workers import Worker
from weightsync.core.routes import ROUTES
from weightsync.serve import schemas
from weightsync.trainer import AsyncWorkerClient, Fleet, WorkerClient, save_checkpoint

DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
NAMES = sorted(ROUTES)


def test_every_registry_route_is_served_with_its_schemas(worker: Worker) -> None:
    spec = httpx.get(f"{worker.url}/openapi.json").json()
    for name, route in ROUTES.items():
        post = spec["paths"][f"/engine/{name}"]["post"]
        assert post["summary"] == route.summary
        ok = post["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok == route.reply, name
    assert set(worker.client.routes()["routes"]) == set(ROUTES)
    assert {name: r.body for name, r in ROUTES.items()} == schemas.BODIES


@pytest.mark.parametrize("name", NAMES)
def test_every_registry_route_is_documented_in_api_md(name: str) -> None:
    assert f"### {name}\n" in DOC


@pytest.mark.parametrize("client", [WorkerClient, AsyncWorkerClient, Fleet])
@pytest.mark.parametrize("name", NAMES)
def test_every_registry_route_has_a_client_method_taking_its_body_fields(client: type, name: str) -> None:
    method = getattr(client, name, None)
    assert callable(method), f"{client.__name__} has no method for {name}"
    params = [p for p in inspect.signature(method).parameters.values() if p.name != "self"]
    if name == "engine_rpc":  # positional and keyword arguments of the engine method
        assert [p.kind for p in params][1:] == [
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ]
        return
    body = ROUTES[name].body
    assert {p.name for p in params} == set(body["properties"])
    required = {p.name for p in params if p.default is inspect.Parameter.empty}
    assert required == set(body["required"])


def test_every_registry_route_is_a_metrics_series_from_the_first_scrape(worker: Worker) -> None:
    text = httpx.get(f"{worker.url}/metrics").text
    for name, route in ROUTES.items():
        assert f'weightsync_admin_requests_total{{code="ok",route="{name}"}} 0.0' in text
        series = f'weightsync_updates_total{{code="ok",route="{name}"}}'
        assert (series in text) is route.update, name


def test_replies_match_the_registry_reply_schemas(worker: Worker) -> None:
    c = worker.client
    path = save_checkpoint(perturbed(worker.engine.model.weights(), seed=1), worker.root / "s1")
    replies = {
        "get_weight_version": c.get_weight_version(),
        "set_weight_version": c.set_weight_version("v0"),
        "pause_generation": c.pause_generation("wait"),
        "update_weights_from_disk": c.update_weights_from_disk(str(path), weight_version="s1"),
        "dry_run": c.update_weights_from_disk(str(path), dry_run=True),
        "weight_info": c.weight_info(),
        "verify_weights": c.verify_weights(),
        "flush_cache": c.flush_cache(),
        "liveness_probe": c.liveness_probe(),
        "clock": c.clock(),
        "resume_generation": c.resume_generation(),
    }
    for name, reply in replies.items():
        route = ROUTES["update_weights_from_disk" if name == "dry_run" else name]
        jsonschema.validate(reply, route.reply)


def test_fleet_sends_the_same_bodies_as_the_client(worker: Worker) -> None:
    fleet = Fleet([worker.url])
    replies = fleet.set_weight_version("fleet", epoch=3)
    assert replies[worker.url]["epoch"] == 3
    assert worker.client.get_weight_version()["version"] == "fleet"
