"""Dynamo 1.6.1's model taints (``dynamo/common/model_taints.py``,
``register_model_taint_route``): ``POST /engine/update/model_taints {"taints": [...]}`` takes
a worker out of routing, here through a real router in front of two real loopback workers.

The bodies and checks of Dynamo's own ``dynamo/common/tests/test_model_taints.py`` are sent
one for one (``test_model_taint_route_updates_worker``: repeats counted once, the reply
``{"status": "ok", "taints": [...]}``; ``test_model_taint_route_rejects_invalid_requests``:
each bad body refused), then what Dynamo's router does with a taint is checked of
weightsync's: a tainted worker gets no request, ``/fleet/status`` and ``fleet status`` show
its taints, and clearing them (``[]``) brings it back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.integration.test_http import wait_until
from tests.workers import Worker
from weightsync.router import Router
from weightsync.router.app import create_router_app
from weightsync.serve import ServerThread


def taint(worker: Worker, body: Any) -> httpx.Response:
    return httpx.post(f"{worker.url}/engine/update/model_taints", json=body, timeout=30)


@pytest.fixture
def fleet(make_worker: Callable[..., Worker]) -> Iterator[tuple[list[Worker], str]]:
    workers = [make_worker() for _ in range(2)]
    for w in workers:
        w.client.set_weight_version("v1")
    router = Router([w.url for w in workers], poll_interval_s=0.1, request_timeout_s=30)
    with ServerThread(create_router_app(router)) as server:
        wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        yield workers, server.url


def served_by(url: str, count: int) -> set[str]:
    body = {"prompt": "taint", "max_tokens": 2, "temperature": 0}
    return {httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["worker"] for _ in range(count)}


def routed_status(url: str) -> dict[str, Any]:
    return {w["url"]: w for w in httpx.get(f"{url}/fleet/status", timeout=30).json()["workers"]}


def test_dynamos_taint_route_answers_as_dynamos_test_and_refuses_its_bad_bodies(
    make_worker: Callable[..., Worker],
) -> None:
    worker = make_worker()
    reply = taint(worker, {"taints": ["capacity/fast", "capacity/fast"]})
    assert reply.status_code == 200 and reply.json() == {"status": "ok", "taints": ["capacity/fast"]}
    assert worker.client.get_weight_version()["taints"] == ["capacity/fast"]
    for body, code in (
        ({}, "wrong_type"),
        ({"taints": "fast"}, "wrong_type"),
        ({"taints": [1]}, "wrong_type"),
        ({"taints": ["dynamo.topology/zone=west"]}, "invalid_value"),
        ({"taints": ["x"] * 257}, "invalid_value"),
        ({"taints": [], "extra": 1}, "unknown_field"),
    ):
        refused = taint(worker, body)
        assert refused.status_code == 400 and refused.json()["code"] == code, (body, refused.text)
    assert worker.client.get_weight_version()["taints"] == ["capacity/fast"]  # a refusal changed nothing
    assert "reserved prefix 'dynamo.topology/'" in taint(worker, {"taints": ["dynamo.topology/a"]}).text


def test_a_tainted_worker_gets_no_request_through_the_router_until_its_taints_are_cleared(
    fleet: tuple[list[Worker], str],
) -> None:
    (first, second), url = fleet
    wait_until(lambda: served_by(url, 4) == {first.url, second.url})
    assert taint(first, {"taints": ["maintenance"]}).status_code == 200
    wait_until(lambda: routed_status(url)[first.url]["taints"] == ["maintenance"])
    status = routed_status(url)
    assert status[first.url]["routable"] is False and status[second.url]["routable"] is True
    assert served_by(url, 8) == {second.url}
    cli = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "fleet", "status", "--json", "--worker", first.url, "--worker", second.url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    shown = {w["url"]: w["taints"] for w in json.loads(cli.stdout)["workers"]}
    assert shown == {first.url: ["maintenance"], second.url: None}  # none: the state alone
    assert taint(first, {"taints": []}).status_code == 200
    wait_until(lambda: served_by(url, 8) == {first.url, second.url})
