"""The poller treats every worker's ``get_weight_version`` reply as hostile, and each
worker's observation stands alone: a reply nested 100,000 deep, a huge reply, or one with
the wrong types fences that worker (``bad_reply``) and never stops the poll from seeing the
others.  The workers are real loopback HTTP servers whose replies the test switches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from weightsync.fleet.journal import Journal
from weightsync.router.poller import MAX_POLL_REPLY_BYTES, Poller
from weightsync.router.view import FleetView

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def polled(version: str = "v0", **extra: Any) -> dict[str, Any]:
    return {
        "status": "ok", "version": version, "version_declared": True, "epoch": None, "digest": "d0",
        "paused": False, "torn": False, "update_in_flight": False, **extra,
    }  # fmt: skip


def answering(raw: bytes) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=raw, content_type="application/json")

    return handler


async def endless(request: web.Request) -> web.StreamResponse:
    """A valid JSON object that never ends: ``{"status":"ok","pad":"aaaa…`` forever."""
    await request.read()
    response = web.StreamResponse(headers={"content-type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    await response.write(b'{"status":"ok","pad":"')
    try:
        while True:
            await response.write(b"a" * (64 << 10))
    except (ConnectionResetError, RuntimeError):  # the poller hung up: the point of the test
        return response


class Workers:
    """Two loopback workers; ``replies[i]`` is the handler worker ``i`` answers polls with."""

    def __init__(self) -> None:
        ok = answering(web.json_response(polled()).body)  # type: ignore[arg-type]
        self.replies: list[Handler] = [ok, ok]
        self.urls: list[str] = []


@asynccontextmanager
async def polled_fleet() -> AsyncIterator[tuple[Workers, Poller]]:
    """Two routable workers on v0 behind a started poller (which never polls on its own
    during the test: its interval is an hour)."""
    workers = Workers()
    runners = []
    for i in range(2):

        async def handler(request: web.Request, i: int = i) -> web.StreamResponse:
            return await workers.replies[i](request)

        app = web.Application()
        app.router.add_post("/engine/get_weight_version", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        workers.urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
    view = FleetView(workers.urls)
    poller = Poller(view, Journal(":memory:"), headers={}, interval_s=3600, busy=lambda: False)
    await poller.start()
    try:
        assert [w.state for w in view.workers.values()] == ["routable", "routable"]
        yield workers, poller
    finally:
        await poller.stop()
        poller.journal.close()
        for runner in runners:
            await runner.cleanup()


def poll_with(hostile: Handler) -> dict[str, tuple[str, str | None]]:
    """Worker 0 answers with ``hostile``, worker 1 with a label nobody committed; one poll;
    every worker's (state, why)."""

    async def run() -> dict[str, tuple[str, str | None]]:
        async with polled_fleet() as (workers, poller):
            workers.replies[0] = hostile
            workers.replies[1] = answering(web.json_response(polled("rogue")).body)  # type: ignore[arg-type]
            await asyncio.wait_for(poller.poll(), 30)
            return {name: (poller.view.workers[u].state, poller.view.workers[u].why)
                    for name, u in zip(("hostile", "rogue"), workers.urls, strict=True)}  # fmt: skip

    return asyncio.run(run())


DEEP = b'{"status":"ok","version":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize(
    "hostile",
    [
        pytest.param(answering(DEEP), id="100000-deep"),
        pytest.param(
            answering(b'{"status":"ok","version":"v0","pad":"' + b"a" * (4 << 20) + b'"}'), id="4MiB"
        ),
        pytest.param(endless, id="endless"),
        pytest.param(answering(b'{"status":"ok","version":"v0","version":"v1"}'), id="duplicate-key"),
        pytest.param(answering(b'{"status":"ok","version":NaN}'), id="nan"),
        pytest.param(answering(web.json_response(polled(epoch="1")).body), id="string-epoch"),  # type: ignore[arg-type]
        pytest.param(answering(web.json_response(polled(torn="no")).body), id="string-torn"),  # type: ignore[arg-type]
    ],
)
def test_a_hostile_poll_reply_fences_that_worker_only_and_the_others_are_still_seen(hostile: Handler) -> None:
    seen = poll_with(hostile)
    assert seen["hostile"] == ("fenced", "bad_reply")
    assert seen["rogue"][0] == "fenced"  # the other worker's observation was applied


def test_the_poll_reply_bound_is_far_above_a_real_reply_and_far_below_a_huge_one() -> None:
    assert len(web.json_response(polled("x" * 60_000)).body) < MAX_POLL_REPLY_BYTES < 4 << 20  # type: ignore[arg-type]
