"""A real ``weightsync router`` in front of two fresh ``weightsync serve`` workers that were never
declared (version undeclared, no epoch, a known digest), before anything was committed: the
router adopts that state as its baseline and serves it, as docs/router.md promises.

One fleet serves the whole module; nothing in it may ever be fenced, so every test checks the
router's fencing counter and its log.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import RouterProcess, WorkerProcess

pytestmark = pytest.mark.slow

POLL_S = 0.2


class Fleet:
    def __init__(self) -> None:
        self.workers = [WorkerProcess() for _ in range(2)]
        for w in self.workers:
            w.wait_ready()
        self.urls = [w.url for w in self.workers]
        self.router = RouterProcess(self.urls, "--poll-interval-s", str(POLL_S)).wait_ready()
        self.http = httpx.Client(base_url=self.router.url, timeout=60)

    def status(self) -> dict[str, Any]:
        reply = self.http.get("/fleet/status")
        assert reply.status_code == 200, reply.text
        return dict(reply.json())

    def digest(self) -> str:
        digests = {httpx.post(f"{u}/engine/get_weight_version", json={}).json()["digest"] for u in self.urls}
        assert len(digests) == 1 and None not in digests, digests
        return str(digests.pop())

    def fencings(self) -> float:
        """``weightsync_router_fencings_total``, summed over every worker and reason."""
        text = self.http.get("/metrics").text
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith("weightsync_router_fencings_total{")
        )

    def assert_never_fenced(self) -> None:
        assert self.fencings() == 0
        log = self.router.log()
        # each worker admitted once, by the router's first poll, and never fenced
        assert log.count(" admitted ") == len(self.urls) and " fenced " not in log, log[-3000:]

    def close(self) -> None:
        self.http.close()
        self.router.stop()
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


def served_undeclared(reply: httpx.Response) -> None:
    """``reply`` is a 200 labelled, by the router's headers, with the undeclared baseline."""
    assert reply.status_code == 200, reply.read()
    assert reply.headers["x-weightsync-weight-version"] == "null"
    assert reply.headers["x-weightsync-weight-epoch"] == "null"


def events(response: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_fresh_undeclared_fleet_is_served_before_any_commit_without_flapping(fleet: Fleet) -> None:
    digest = fleet.digest()
    undeclared = {"version": None, "version_declared": False, "epoch": None, "digest": digest}
    served: set[str] = set()
    samples: list[dict[str, Any]] = []
    deadline = time.monotonic() + 8 * POLL_S  # several polls, each one an occasion to flap
    while time.monotonic() < deadline or len(samples) < 8:
        reply = fleet.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        served_undeclared(reply)
        body = reply.json()
        # stamped with the undeclared state, as the workers stamp it
        assert (body["weight_version"], body["weight_version_declared"], body["weight_epoch"]) == (
            None, False, None,
        )  # fmt: skip
        assert all(s["digest"] == digest for s in body["weight_version_spans"])
        served.add(body["worker"])
        samples.append(fleet.status())
        time.sleep(POLL_S / 2)
    assert served == set(fleet.urls)  # both workers took requests
    for status in samples:
        assert status["baseline"]["source"] == "workers"
        assert status["baseline"]["label"] == undeclared
        assert (status["epoch"], status["version"]) == (None, None)
        for w in status["workers"]:
            assert (w["state"], w["routable"], w["fenced"], w["why"]) == ("routable", True, False, None), w
            assert {k: w[k] for k in undeclared} == undeclared
    fleet.assert_never_fenced()


def test_streams_chat_and_generate_are_served_from_the_undeclared_baseline(fleet: Fleet) -> None:
    with fleet.http.stream(
        "POST", "/v1/completions", json={"prompt": "relay", "max_tokens": 6, "stream": True}
    ) as r:
        served_undeclared(r)
        streamed = events(r)
    assert streamed[-1] == "[DONE]" and len(streamed) > 2
    assert all(e["weight_version"] is None and e["weight_version_declared"] is False for e in streamed[:-1])

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    reply = fleet.http.post("/v1/chat/completions", json=chat)
    served_undeclared(reply)
    assert reply.json()["weight_version"] is None and reply.json()["weight_epoch"] is None
    with fleet.http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        served_undeclared(r)
        streamed = events(r)
    assert streamed[-1] == "[DONE]" and all(e["weight_version"] is None for e in streamed[:-1])

    # SGLang's /generate says "default" while undeclared, as SGLang does
    generate = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    reply = fleet.http.post("/generate", json=generate)
    served_undeclared(reply)
    assert reply.json()["meta_info"]["weight_version"] == "default"
    batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    served_undeclared(fleet.http.post("/generate", json=batch))
    fleet.assert_never_fenced()


def test_a_request_for_a_version_or_a_relabel_is_refused_without_fencing_the_undeclared_fleet(
    fleet: Fleet,
) -> None:
    for bound in ({"weight_version": "default"}, {"weight_version": None}, {"min_weight_epoch": 1}):
        # undeclared weights are no version, not even null's, and at epoch 0
        reply = fleet.http.post("/v1/completions", json={"prompt": "x", **bound})
        assert reply.status_code == 503 and reply.json()["code"] == "no_fresh_worker", reply.text
    served_undeclared(fleet.http.post("/v1/completions", json={"prompt": "x", "min_weight_epoch": 0}))
    relabel = fleet.http.post("/fleet/set_weight_version", json={"weight_version": "v1"})
    assert relabel.status_code == 409 and relabel.json()["code"] == "no_committed_source", relabel.text
    assert all(w["routable"] for w in fleet.status()["workers"])
    fleet.assert_never_fenced()
