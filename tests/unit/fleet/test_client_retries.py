"""AsyncWorkerClient's deadline-aware retries, counted at the transport (every attempt is seen)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from weightsync.core.errors import EngineUnavailable
from weightsync.trainer.client import AsyncWorkerClient


def flaky(failures: int) -> tuple[httpx.MockTransport, list[str]]:
    attempts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(request.url.path)  # counted before it fails: a refused connect is an attempt
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
    client = AsyncWorkerClient("http://127.0.0.1:9", transport=transport, retries=2, backoff_s=0.001)
    assert call(client)["alive"] is True
    assert len(attempts) == 3


def test_without_retries_the_first_refusal_is_unreachable() -> None:
    transport, attempts = flaky(1)
    client = AsyncWorkerClient("http://127.0.0.1:9", transport=transport, retries=0)
    with pytest.raises(EngineUnavailable) as err:
        call(client)
    assert err.value.code == "unreachable" and len(attempts) == 1


def test_no_retry_starts_that_the_deadline_could_not_wait_for() -> None:
    transport, attempts = flaky(10)
    client = AsyncWorkerClient("http://127.0.0.1:9", transport=transport, retries=10, backoff_s=5.0)
    with pytest.raises(EngineUnavailable) as err:
        call(client.within(time.monotonic() + 1.0))
    assert err.value.code == "unreachable" and len(attempts) == 1
