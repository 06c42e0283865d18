"""A real ``weightsync router`` in front of three real ``weightsync serve`` workers on loopback.

One fleet serves the whole module (workers take seconds to start on a small machine), so
the tests run in file order and each leaves the fleet routable for the next; the last one
kills a worker.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import TINY, RouterProcess, WorkerProcess, perturbed
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer.checkpoint import save_checkpoint

pytestmark = pytest.mark.slow

POLL_S = 0.2


class Fleet:
    def __init__(self, tmp: Path) -> None:
        weights = dict(ReferenceEngine(TINY).model.weights())
        self.ckpts = [save_checkpoint(weights, tmp / "step-0")]
        for seed in (1, 2, 3):
            self.ckpts.append(save_checkpoint(perturbed(weights, seed=seed), tmp / f"step-{seed}"))
        self.workers = [WorkerProcess("--initial-version", '"v0"') for _ in range(3)]
        for w in self.workers:
            w.wait_ready()
        self.urls = [w.url for w in self.workers]
        self.journal = tmp / "fleet.db"
        self.router = RouterProcess(
            self.urls, "--poll-interval-s", str(POLL_S), "--journal", str(self.journal),
            "--initial-source", str(self.ckpts[0]),
        ).wait_ready()  # fmt: skip
        self.http = httpx.Client(base_url=self.router.url, timeout=120)

    def status(self) -> dict[str, Any]:
        reply = self.http.get("/fleet/status")
        assert reply.status_code == 200, reply.text
        return dict(reply.json())

    def worker_state(self, url: str) -> dict[str, Any]:
        return dict(httpx.post(f"{url}/engine/get_weight_version", json={}, timeout=10).json())

    def wait_for(self, what: Callable[[dict[str, Any]], bool], timeout: float = 15) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if what(status):
                return status
            assert time.monotonic() < deadline, f"timed out; last status: {json.dumps(status)}"
            time.sleep(0.05)

    def states(self, status: dict[str, Any] | None = None) -> dict[str, str]:
        return {w["url"]: w["state"] for w in (status or self.status())["workers"]}

    def metric(self, name: str, **labels: str) -> float:
        text = self.http.get("/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                series, _, value = line.rpartition(" ")
                got = series[len(name) :].strip("{}")
                if all(part in got.split(",") for part in want.split(",") if part):
                    total += float(value)
        return total

    def close(self) -> None:
        self.http.close()
        self.router.stop()
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("router"))
    try:
        yield f
    finally:
        f.close()


async def load(
    url: str, clients: int, until: Callable[[], bool], body: dict[str, Any] | None = None, **kw: Any
) -> list[tuple[int, dict[str, Any], httpx.Headers]]:
    """``clients`` concurrent callers sending completions until ``until()``; every reply."""
    out: list[tuple[int, dict[str, Any], httpx.Headers]] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not until():
            r = await http.post(
                "/v1/completions", json={"prompt": "abc", "max_tokens": 4, **(body or {})}, **kw
            )
            out.append((r.status_code, r.json(), r.headers))
            if r.status_code == 503:
                await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return out


def test_router_adopts_the_workers_agreed_state_and_routes_at_once(fleet: Fleet) -> None:
    status = fleet.status()
    assert status["baseline"]["source"] == "workers"
    assert status["baseline"]["label"]["version"] == "v0"
    assert all(w["routable"] and not w["fenced"] for w in status["workers"])
    reply = fleet.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200
    body = reply.json()
    assert body["worker"] in fleet.urls and body["weight_version"] == "v0"
    assert reply.headers["x-weightsync-weight-version"] == '"v0"'


BAD_INPUT: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("POST", "/v1/completions", {"content": b"{nope"}, 400, "invalid_json"),
    ("POST", "/v1/completions", {"json": [1, 2]}, 400, "not_an_object"),
    ("POST", "/v1/completions", {"content": b'{"a": 1, "a": 2}'}, 400, "invalid_json"),
    ("POST", "/v1/completions", {"json": {"prompt": "x", "max_staleness": -1}}, 400, "invalid_value"),
    ("POST", "/v1/completions", {"json": {"prompt": "x", "min_weight_epoch": "1"}}, 400, "wrong_type"),
    ("POST", "/v1/completions", {"json": {"prompt": "x"}, "headers": {"x-weightsync-version-policy": "newest"}},
     400, "invalid_policy"),
    ("POST", "/v1/completions", {"json": {"prompt": "x", "bogus": 1}}, 400, "unknown_field"),  # the worker's
    ("POST", "/v1/completions", {"content": b"x" * (17 << 20)}, 413, "payload_too_large"),
    ("POST", "/v1/completions", {"content": b"{}", "headers": {"content-type": "text/plain"}},
     415, "unsupported_media_type"),
    ("POST", "/v1/completions", {"json": {}, "headers": {"origin": "http://evil.example"}}, 403, "forbidden_origin"),
    ("POST", "/v1/completions", {"json": {}, "headers": {"host": "evil.example"}}, 403, "forbidden_host"),
    ("POST", "/fleet/update_weights_from_disk", {"json": {}}, 400, "missing_field"),
    ("POST", "/fleet/update_weights_from_disk", {"json": {"model_path": "/x"}}, 400, "missing_field"),
    ("POST", "/fleet/update_weights_from_disk", {"json": {"model_path": "/x", "weight_version": 1,
     "max_unavailable": 0}}, 400, "invalid_value"),
    ("POST", "/fleet/update_weights_from_disk", {"json": {"model_path": "/x", "weight_version": 1,
     "max_unavailable": 4}}, 400, "invalid_value"),
    ("POST", "/fleet/update_weights_from_disk", {"json": {"model_path": "/x", "weight_version": 1,
     "policy": "yolo"}}, 400, "invalid_value"),
    ("POST", "/fleet/update_weights_from_disk", {"json": {"model_path": "/x", "weight_version": 1,
     "deadline_s": 1e300}}, 400, "invalid_value"),
    ("POST", "/fleet/update_weights_from_disk", {"json": {"model_path": "/x", "weight_version": 1,
     "allow_unpaused": True}}, 400, "unknown_field"),
    ("POST", "/fleet/update_weights_from_disk", {"json": {"model_path": 3, "weight_version": 1}}, 400, "wrong_type"),
    ("POST", "/fleet/update_weights_from_disk", {"json": {"model_path": "/nonexistent", "weight_version": 1}},
     409, "prepare_refused"),
    ("POST", "/fleet/set_weight_version", {"json": {}}, 400, "missing_field"),
    ("POST", "/fleet/set_weight_version", {"json": {"weight_version": "x", "epoch": 9}}, 400, "unknown_field"),
    ("POST", "/fleet/pause_generation", {"json": {"mode": "sleep"}}, 400, "invalid_value"),
    ("POST", "/fleet/pause_generation", {"json": {"clear_cache": "false"}}, 400, "wrong_type"),
    ("POST", "/fleet/resume_generation", {"json": {"x": 1}}, 400, "unknown_field"),
    ("POST", "/fleet/resume_generation", {"content": b"[]"}, 400, "not_an_object"),
    ("GET", "/fleet/nothing", {}, 404, "unknown_route"),
    ("GET", "/v1/completions", {}, 405, "method_not_allowed"),
    ("POST", "/fleet/status", {"json": {}}, 405, "method_not_allowed"),
]  # fmt: skip


def test_bad_input_on_every_router_route_is_a_4xx_with_a_code_and_changes_nothing(fleet: Fleet) -> None:
    before = {u: fleet.worker_state(u) for u in fleet.urls}
    status_before = fleet.status()
    for method, path, kw, code, error in BAD_INPUT:
        if "content" in kw:
            kw = {**kw, "headers": {"content-type": "application/json", **kw.get("headers", {})}}
        reply = fleet.http.request(method, path, **kw)
        assert reply.status_code == code, (path, kw, reply.text)
        body = reply.json()
        assert body["status"] == "error" and body["code"] == error, (path, kw, body)
        assert isinstance(body["message"], str) and body["message"]
    assert {u: fleet.worker_state(u) for u in fleet.urls} == before
    after = fleet.status()
    assert (after["epoch"], after["version"], fleet.states(after)) == (
        status_before["epoch"], status_before["version"], fleet.states(status_before),
    )  # fmt: skip
    assert all(w["routable"] for w in after["workers"])


def test_bearer_auth_and_public_bind_without_a_key(fleet: Fleet, tmp_path: Path) -> None:
    keyed = RouterProcess(fleet.urls, "--api-key", "s3cret", "--poll-interval-s", "1").wait_ready()
    try:
        for method, path in (
            ("POST", "/v1/completions"),
            ("GET", "/fleet/status"),
            ("POST", "/fleet/resume_generation"),
        ):
            r = httpx.request(method, keyed.url + path, json={"prompt": "x"})
            assert r.status_code == 401 and r.json()["code"] == "unauthorized", path
        r = httpx.post(
            keyed.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
            headers={"authorization": "Bearer s3cret"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
    finally:
        keyed.stop()
    refused = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "router", "--host", "0.0.0.0", "--worker", fleet.urls[0]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "api_key_required" in refused.stderr


def test_the_router_is_the_journals_one_writer(fleet: Fleet) -> None:
    journal = str(fleet.journal)
    second = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "router", "--journal", journal, "--worker", fleet.urls[0]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 2 and "journal_locked" in second.stderr, second.stderr
    beside = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "fleet", "update", "--journal", journal,
         "--from-disk", str(fleet.ckpts[1]), "--version", "x", *(a for u in fleet.urls for a in ("--worker", u))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert beside.returncode != 0 and "journal_locked" in beside.stderr, beside.stderr
    assert all(w["routable"] and w["version"] == "v0" for w in fleet.status()["workers"])


def committed_epochs(fleet: Fleet) -> dict[str, int]:
    """version -> epoch for every label the journal-backed router reports as committed."""
    status = fleet.status()
    return {json.dumps(w["version"]): w["epoch"] for w in status["workers"]}


def test_a_fleet_update_through_the_router_serves_only_committed_states(fleet: Fleet) -> None:
    done = False
    replies: list[tuple[int, dict[str, Any], httpx.Headers]] = []

    async def run() -> dict[str, Any]:
        nonlocal done, replies
        task = asyncio.create_task(load(fleet.router.url, 4, lambda: done))
        async with httpx.AsyncClient(base_url=fleet.router.url, timeout=120) as http:
            await asyncio.sleep(0.3)
            r = await http.post(
                "/fleet/update_weights_from_disk",
                json={"model_path": str(fleet.ckpts[1]), "weight_version": "v1"},
            )
            await asyncio.sleep(0.3)
        done = True
        replies = await task
        return dict(r.json())

    result = asyncio.run(run())
    assert result["status"] == "ok" and result["committed"], result
    epoch = result["epoch"]
    served = {(b["weight_version"], b["weight_epoch"]) for s, b, _ in replies if s == 200}
    assert served <= {("v0", None), ("v1", epoch)}, served
    assert ("v1", epoch) in served
    for status, body, headers in replies:
        if status != 200:  # every worker is out while max_unavailable = N: a retryable 503, at once
            assert (status, body["code"]) == (503, "no_worker") and int(headers["retry-after"]) >= 1, body
    status = fleet.wait_for(lambda s: all(w["routable"] for w in s["workers"]))
    assert status["epoch"] == epoch and status["version"] == "v1"
    assert all(w["epoch"] == epoch for w in status["workers"])


Sent = tuple[float, float, int, dict[str, Any], httpx.Headers]


async def timed_load(
    url: str,
    clients: int,
    until: Callable[[], bool],
    bodies: list[dict[str, Any]],
    headers: list[dict[str, str]],
) -> list[Sent]:
    """Like :func:`load`, client ``i`` sending ``bodies[i % len]`` with ``headers[i % len]``;
    each reply with the time its request was sent and the time it came back."""
    out: list[Sent] = []

    async def client(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"client {i}", "max_tokens": 4, **bodies[i % len(bodies)]}
        while not until():
            sent = time.monotonic()
            r = await http.post("/v1/completions", json=body, headers=headers[i % len(headers)])
            out.append((sent, time.monotonic(), r.status_code, r.json(), r.headers))
            if r.status_code == 503:
                await asyncio.sleep(0.02)

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await asyncio.gather(*(client(http, i) for i in range(clients)))
    return out


def rolling_update(fleet: Fleet, ckpt: Path, version: str, clients: int, bodies: list[dict[str, Any]],
                   headers: list[dict[str, str]]) -> tuple[dict[str, Any], list[Sent]]:  # fmt: skip
    done = False

    async def run() -> tuple[dict[str, Any], list[Sent]]:
        nonlocal done
        task = asyncio.create_task(timed_load(fleet.router.url, clients, lambda: done, bodies, headers))
        async with httpx.AsyncClient(base_url=fleet.router.url, timeout=300) as http:
            await asyncio.sleep(0.5)
            r = await http.post(
                "/fleet/update_weights_from_disk",
                json={"model_path": str(ckpt), "weight_version": version, "max_unavailable": 1},
            )
            await asyncio.sleep(0.5)
        done = True
        return dict(r.json()), await task

    return asyncio.run(run())


def test_eight_clients_during_a_rolling_update_with_max_unavailable_1_fail_no_request(fleet: Fleet) -> None:
    before = fleet.status()
    old = (before["version"], before["epoch"])
    result, replies = rolling_update(fleet, fleet.ckpts[2], "v2", 8, [{}], [{}])
    assert result["status"] == "ok" and result["committed"], result
    new = ("v2", result["epoch"])
    assert new[1] > old[1]
    assert replies and [r for r in replies if r[2] != 200] == []  # zero failed requests
    served = {(b["weight_version"], b["weight_epoch"]) for _, _, _, b, _ in replies}
    assert served <= {old, new}, served  # every reply's version and epoch were committed
    assert new in served
    for _, _, _, body, headers in replies:
        assert headers["x-weightsync-weight-epoch"] == str(body["weight_epoch"])
        assert headers["x-weightsync-weight-version"] == json.dumps(body["weight_version"])
    status = fleet.wait_for(lambda s: all(w["routable"] for w in s["workers"]))
    assert (status["version"], status["epoch"]) == new
    assert all((w["version"], w["epoch"]) == new for w in status["workers"])
    assert all((fleet.worker_state(u)["version"], fleet.worker_state(u)["epoch"]) == new for u in fleet.urls)
    assert fleet.metric("weightsync_router_rolling_update_batches") == 3
    assert fleet.metric("weightsync_router_rolling_update_batches_done") == 3


def test_max_staleness_0_during_a_rolling_update_reaches_only_updated_workers(fleet: Fleet) -> None:
    old_epoch = fleet.status()["epoch"]
    result, replies = rolling_update(
        fleet, fleet.ckpts[1], "v3", 4,
        [{"max_staleness": 0}, {}], [{}, {"x-weightsync-version-policy": "max-staleness:0"}],
    )  # fmt: skip
    assert result["status"] == "ok", result
    new_epoch = result["epoch"]
    fresh = [r for r in replies if r[2] == 200 and r[3]["weight_epoch"] == new_epoch]
    assert fresh, "no request reached an updated worker"
    # Once one reply came from the new epoch, the router knew it was committed: every request
    # sent after that reached an updated worker or got the 503, never an old one.
    first_new = min(back for _, back, _, _, _ in fresh)
    assert any(sent > first_new for sent, *_ in replies), "no request was sent after the first commit"
    for sent, _, status, body, headers in replies:
        if status == 200:
            assert body["weight_epoch"] in (old_epoch, new_epoch)
            if sent > first_new:
                assert body["weight_epoch"] == new_epoch, body
        else:
            assert (status, body["code"]) == (503, "no_fresh_worker"), body
            assert int(headers["retry-after"]) >= 1 and body["message"]
    fleet.wait_for(lambda s: all(w["routable"] and w["epoch"] == new_epoch for w in s["workers"]))


def test_a_worker_paused_behind_the_routers_back_is_fenced_and_a_resume_returns_it(fleet: Fleet) -> None:
    victim = fleet.urls[0]
    before = fleet.metric("weightsync_router_fencings_total", worker=victim)
    assert httpx.post(f"{victim}/engine/pause_generation", json={}).status_code == 200
    status = fleet.wait_for(lambda s: fleet.states(s)[victim] == "fenced")
    assert next(w for w in status["workers"] if w["url"] == victim)["why"] == "seen_paused"
    assert fleet.metric("weightsync_router_fencings_total", worker=victim, reason="seen_paused") >= 1
    assert fleet.metric("weightsync_router_fencings_total", worker=victim) == before + 1
    servers = {
        fleet.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()["worker"]
        for _ in range(6)
    }
    assert victim not in servers
    assert httpx.post(f"{victim}/engine/resume_generation", json={}).status_code == 200
    fleet.wait_for(lambda s: fleet.states(s)[victim] == "routable")


def test_a_worker_given_new_weights_behind_the_routers_back_is_fenced_by_digest(fleet: Fleet) -> None:
    victim = fleet.urls[1]
    label = {k: fleet.worker_state(victim)[k] for k in ("version", "epoch")}
    foreign = httpx.post(
        f"{victim}/engine/update_weights_from_disk",
        json={"model_path": str(fleet.ckpts[3]), "allow_unpaused": True, "reset_prefix_cache": False},
        timeout=60,
    )
    assert foreign.status_code == 200, foreign.text
    assert {
        k: fleet.worker_state(victim)[k] for k in ("version", "epoch")
    } == label  # same label, other digest
    status = fleet.wait_for(lambda s: fleet.states(s)[victim] == "fenced")
    assert next(w for w in status["workers"] if w["url"] == victim)["why"] == "seen_uncommitted"
    servers = {
        fleet.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()["worker"]
        for _ in range(6)
    }
    assert victim not in servers
    # Only a transaction brings it back: every worker loads and attests the next checkpoint.
    r = fleet.http.post(
        "/fleet/update_weights_from_disk", json={"model_path": str(fleet.ckpts[2]), "weight_version": "v2"}
    )
    assert r.status_code == 200, r.text
    fleet.wait_for(lambda s: all(w["routable"] for w in s["workers"]))


def test_a_sigkilled_worker_is_fenced_within_the_poll_interval_and_later_requests_succeed(
    fleet: Fleet,
) -> None:
    victim = fleet.workers[2]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    # No request is sent until it is fenced: the poller alone finds it.
    status = fleet.wait_for(lambda s: fleet.states(s)[victim.url] == "unreachable", timeout=10)
    assert next(w for w in status["workers"] if w["url"] == victim.url)["fenced"]
    assert fleet.metric("weightsync_router_fencings_total", worker=victim.url, reason="unreachable") >= 1
    assert fleet.metric("weightsync_router_worker_fenced", worker=victim.url) == 1
    assert fleet.metric("weightsync_router_worker_routable", worker=victim.url) == 0
    deadline = time.monotonic() + 3
    replies = asyncio.run(load(fleet.router.url, 4, lambda: time.monotonic() > deadline))
    assert replies and all(s == 200 and b["worker"] != victim.url for s, b, _ in replies)
