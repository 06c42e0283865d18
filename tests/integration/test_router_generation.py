"""The generation routes through a real router (in process) in front of a real worker:
chat, SGLang's ``/generate`` and ``/v1/models`` relayed; streams relayed event by event with
the worker's stamps and the version in the headers; the freshness policy refuses before the
first byte; a client leaving the router's stream frees the request on the worker."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.integration.test_http import PACED, wait_until
from tests.workers import Worker
from weightsync.router import Router
from weightsync.router.app import create_router_app
from weightsync.serve import ServerThread


@pytest.fixture
def fleet(make_worker: Callable[..., Worker]) -> Iterator[tuple[Worker, str]]:
    """A paced worker declaring ``"v1"`` and a router over it, routable."""
    worker = make_worker(PACED)
    worker.client.set_weight_version("v1")
    router = Router([worker.url], poll_interval_s=0.1, request_timeout_s=30)
    with ServerThread(create_router_app(router)) as server:
        wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        yield worker, server.url


def lines(response: httpx.Response, into: list[Any]) -> None:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            into.append(data if data == "[DONE]" else json.loads(data))


def test_chat_generate_and_models_are_relayed(fleet: tuple[Worker, str]) -> None:
    worker, url = fleet
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
        ("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}),
    ):
        direct = httpx.post(f"{worker.url}{path}", json=body, timeout=60).json()
        routed = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert routed.status_code == 200, routed.text
        assert routed.headers["x-weightsync-weight-version"] == '"v1"'
        got = routed.json()
        if isinstance(direct, list):
            assert [g["output_ids"] for g in got] == [d["output_ids"] for d in direct]
        elif "choices" in direct:
            assert (
                got["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
                and got["worker"] == worker.url
            )
        else:
            assert got["output_ids"] == direct["output_ids"] and got["meta_info"]["weight_version"] == "v1"
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "reference"


def test_a_stream_is_relayed_event_by_event_with_the_workers_stamps(fleet: tuple[Worker, str]) -> None:
    worker, url = fleet
    body = {"prompt": "relay", "max_tokens": 8, "stream": True, "logprobs": 1}
    direct: list[Any] = []
    with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, timeout=60) as r:
        lines(r, direct)
    routed: list[Any] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert (
            r.headers["x-weightsync-weight-version"] == '"v1"'
            and r.headers["x-weightsync-worker"] == worker.url
        )
        lines(r, routed)
    assert routed[-1] == "[DONE]" and all(e["weight_version"] == "v1" for e in routed[:-1])
    text = ["".join(e["choices"][0]["text"] for e in events[:-1]) for events in (direct, routed)]
    assert text[0] == text[1]
    assert routed[-2]["choices"][0]["weight_version_spans"][0]["version"] == "v1"


def test_the_freshness_policy_refuses_a_stream_before_its_first_byte(fleet: tuple[Worker, str]) -> None:
    _, url = fleet
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "stream": True, "weight_version": "v9"})
    assert reply.status_code == 503 and reply.headers["content-type"] == "application/json"
    assert reply.json()["code"] == "no_fresh_worker"


def test_a_client_leaving_the_routers_stream_frees_the_request_on_the_worker(
    fleet: tuple[Worker, str],
) -> None:
    worker, url = fleet
    body = {"prompt": "leaving", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        reading = r.iter_lines()  # (left open: closing it would close the response)
        for _ in range(4):
            next(reading)
        worker.client.pause_generation("keep")  # the request is held, no token flows: only leaving frees it
        assert len(worker.engine.in_flight()) == 1
    wait_until(lambda: not worker.engine.in_flight(), timeout=5)
    worker.client.resume_generation()
