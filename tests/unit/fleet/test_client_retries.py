"""AsyncWorkerClient's deadline-aware retries, counted at the transport (every attempt is seen)."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest

from weightsync.core.errors import EngineUnavailable
from weightsync.trainer.client import AsyncWorkerClient

SLACK = 1e-3
"""Seconds an event loop's timer may fire early (its clock resolution, rounded up)."""


def flaky(failures: int) -> tuple[httpx.MockTransport, list[float]]:
    """A transport that refuses the first ``failures`` connections, and the
    :func:`time.monotonic` of every attempt it saw."""
    attempts: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(time.monotonic())  # counted before it fails: a refused connect is an attempt
        if len(attempts) <= failures:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"status": "ok", "alive": True})

    return httpx.MockTransport(handler), attempts


def call(client: AsyncWorkerClient) -> dict[str, object]:
    async def go() -> dict[str, object]:
        try:
            return dict(await client.liveness_probe())
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_refused_connection_is_retried_with_backoff_until_it_answers() -> None:
    transport, attempts = flaky(2)
    client = AsyncWorkerClient("http://127.0.0.1:9", transport=transport, retries=2, backoff_s=0.05)
    assert call(client)["alive"] is True
    assert len(attempts) == 3
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
    # Lower bounds only (a loaded machine may wait longer, never shorter): 0.05 s, then 0.1 s.
    assert gaps[0] >= 0.05 - SLACK and gaps[1] >= 0.1 - SLACK, gaps


def test_the_backoff_doubles_from_backoff_s_up_to_max_backoff_s(monkeypatch: pytest.MonkeyPatch) -> None:
    transport, attempts = flaky(5)
    slept: list[tuple[float, int]] = []  # (seconds asked for, attempts made by then)
    real_sleep = asyncio.sleep

    async def recorded_sleep(seconds: float) -> None:
        slept.append((seconds, len(attempts)))
        await real_sleep(0)

    # The client's only sleep is its backoff (the mock transport never sleeps), so every
    # sleep recorded in this loop is one the retry policy asked for.
    monkeypatch.setattr("weightsync.trainer.client.asyncio.sleep", recorded_sleep)
    client = AsyncWorkerClient(
        "http://127.0.0.1:9", transport=transport, retries=5, backoff_s=0.01, max_backoff_s=0.05
    )
    assert call(client)["alive"] is True
    assert len(attempts) == 6
    assert [n for _, n in slept] == [1, 2, 3, 4, 5]  # once between each two attempts
    assert [s for s, _ in slept] == pytest.approx([0.01, 0.02, 0.04, 0.05, 0.05])


def test_without_retries_the_first_refusal_is_unreachable() -> None:
    transport, attempts = flaky(1)
    client = AsyncWorkerClient("http://127.0.0.1:9", transport=transport, retries=0)
    with pytest.raises(EngineUnavailable) as err:
        call(client)
    assert err.value.code == "unreachable" and len(attempts) == 1
    assert err.value.details["sent"] is False  # no connection: it can never reach the worker


def test_a_request_that_got_no_answer_in_time_may_have_been_sent() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(10)
        return httpx.Response(200, json={"status": "ok", "alive": True})

    client = AsyncWorkerClient("http://127.0.0.1:9", transport=httpx.MockTransport(handler))
    with pytest.raises(EngineUnavailable) as err:
        call(client.within(time.monotonic() + 0.2))
    assert err.value.code == "timeout" and "sent" not in err.value.details
    with pytest.raises(EngineUnavailable) as err:
        call(client.within(time.monotonic() - 1))
    assert err.value.code == "timeout" and err.value.details["sent"] is False  # no time was left


def test_no_retry_starts_that_the_deadline_could_not_wait_for() -> None:
    transport, attempts = flaky(10)
    client = AsyncWorkerClient("http://127.0.0.1:9", transport=transport, retries=10, backoff_s=5.0)
    with pytest.raises(EngineUnavailable) as err:
        call(client.within(time.monotonic() + 1.0))
    assert err.value.code == "unreachable" and len(attempts) == 1
