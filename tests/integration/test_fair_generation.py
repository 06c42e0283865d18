"""One request cannot starve the others: a completion with more stop strings than a request may
give is refused before it is scheduled, on every generation route, and one at the bound runs
beside a short request, which still finishes.  Real loopback workers."""

from __future__ import annotations

import threading

import httpx

from tests.workers import Worker
from weightsync.engines.sampling import MAX_STOP_BYTES, MAX_STOPS


def test_a_million_stop_strings_are_refused_at_once(worker: Worker) -> None:
    many = [f"s{i}" for i in range(1_000_000)]
    for path, body in (
        ("/v1/completions", {"prompt": [10, 20], "max_tokens": 8, "stop": many, "n": 4}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stop": many},
        ),
        ("/generate", {"input_ids": [10, 20], "sampling_params": {"max_new_tokens": 8, "stop": many}}),
    ):
        reply = httpx.post(f"{worker.url}{path}", json=body, timeout=120)
        assert reply.status_code in (400, 413), (path, reply.text[:300])
        if reply.status_code == 400:
            assert "stop" in reply.text[:2000], reply.text[:300]
    assert (
        httpx.post(f"{worker.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}).status_code
        == 200
    )


def test_stop_strings_past_the_bound_are_a_400_naming_the_field(worker: Worker) -> None:
    for stop in ([f"{i:03d}" for i in range(MAX_STOPS + 1)], ["x" * (MAX_STOP_BYTES + 1)]):
        reply = httpx.post(
            f"{worker.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "stop": stop}
        )
        assert reply.status_code == 400, reply.text[:300]
        error = reply.json()
        assert "invalid_value" in str(error) and "stop" in str(error)


def test_a_request_at_the_bound_runs_beside_a_short_one(worker: Worker) -> None:
    """The longest legal stop strings (never matched) and n=4, beside an 8-token request: both
    finish, the heavy one to its length, the short one with its own 8 tokens."""
    per = MAX_STOP_BYTES // MAX_STOPS
    stops = [f"{i:03d}" + "\x7f" * (per - 3) for i in range(MAX_STOPS)]
    heavy: dict[str, object] = {}

    def run_heavy() -> None:
        body = {"prompt": [10, 20], "max_tokens": 64, "n": 4, "stop": stops, "ignore_eos": True}
        heavy["reply"] = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=120)

    thread = threading.Thread(target=run_heavy)
    thread.start()
    short = httpx.post(
        f"{worker.url}/v1/completions",
        json={"prompt": [1, 2], "max_tokens": 8, "ignore_eos": True},
        timeout=60,
    )
    thread.join()
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 8
    reply = heavy["reply"]
    assert isinstance(reply, httpx.Response) and reply.status_code == 200, reply
    assert [c["finish_reason"] for c in reply.json()["choices"]] == ["length"] * 4
