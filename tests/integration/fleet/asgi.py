"""A fleet of real worker apps in this process: ``httpx.ASGITransport`` over ``create_app``.

Every worker is a real :class:`~weightsync.core.Controller` over a real reference engine,
reached through the real client; nothing answers on a worker's behalf unless a test says
so with :meth:`AsgiFleet.intercept` (a worker that lies, refuses, or is down).  A worker
can be restarted: a fresh engine and controller behind the same URL, or stopped and
continued as SIGSTOP and SIGCONT would (:meth:`AsgiFleet.stop`, :meth:`AsgiFleet.cont`).
A worker's clock can run off this process's by ``skew[url]`` seconds (the controller's
``clock``, as a worker on another machine whose clock is off).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import TINY, perturbed
from weightsync.core import Controller
from weightsync.core.held import weights_digest
from weightsync.core.snapshot import Declared
from weightsync.engines.reference import ReferenceEngine
from weightsync.fleet import FleetCoordinator, Journal
from weightsync.serve import create_app
from weightsync.trainer import save_checkpoint
from weightsync.transports.hashing import tensor_hashes

Intercept = Callable[[httpx.Request, dict[str, Any]], httpx.Response | None]


class AsgiFleet(httpx.AsyncBaseTransport):
    def __init__(self, root: Path, n: int, skew: dict[int, float] | None = None) -> None:
        self.root = root
        weights = dict(ReferenceEngine(TINY).model.weights())
        self.old = str(save_checkpoint(weights, root / "step-0"))
        self.new = str(save_checkpoint(perturbed(weights), root / "step-1"))
        self.old_digest = weights_digest(tensor_hashes(weights.items()))
        self.new_digest = weights_digest(tensor_hashes(perturbed(weights).items()))
        self.urls = [f"http://127.0.0.1:{9100 + i}" for i in range(n)]
        self.apps: dict[str, httpx.ASGITransport] = {}
        self.controllers: dict[str, Controller] = {}
        self.down: set[str] = set()
        self.intercepts: dict[tuple[str, str], Intercept] = {}
        self.calls: list[tuple[str, str]] = []
        self.called_at: list[float] = []  # time.time() of each of calls
        self.slow: dict[tuple[str, str], float] = {}  # (url, route) -> seconds before it answers
        self.stopped: set[str] = set()
        self.held: list[tuple[str, str, bytes]] = []  # (url, route, body) sent to a stopped worker
        self.skew = {self.urls[i]: s for i, s in (skew or {}).items()}  # seconds its clock runs ahead
        for url in self.urls:
            self.restart(url)

    def restart(self, url: str) -> None:
        """A fresh worker behind ``url``: seeded initial weights, version ``"v0"``, no epoch."""
        engine = ReferenceEngine(TINY, allowed_weight_dirs=[self.root])
        skew = self.skew.get(url, 0.0)
        clock = (lambda: time.time() + skew) if skew else time.time
        self.controllers[url] = Controller(engine, version=Declared("v0"), clock=clock)
        self.apps[url] = httpx.ASGITransport(app=create_app(self.controllers[url]))

    def stop(self, url: str) -> None:
        """SIGSTOP ``url``: it takes every request sent to it (the kernel keeps them) and
        answers none, until :meth:`cont`."""
        self.stopped.add(url)

    def cont(self, url: str) -> list[httpx.Response]:
        """SIGCONT ``url``: it reads every request sent to it while it was stopped, in order,
        though whoever sent them stopped waiting long ago; its replies."""
        self.stopped.discard(url)
        held = [(route, body) for u, route, body in self.held if u == url]
        self.held = [h for h in self.held if h[0] != url]

        async def replay() -> list[httpx.Response]:
            async with httpx.AsyncClient(transport=self.apps[url], base_url=url) as client:
                headers = {"content-type": "application/json"}
                return [await client.post(f"/engine/{r}", content=b, headers=headers) for r, b in held]

        return asyncio.run(replay())

    def intercept(self, url: str, route: str, handler: Intercept) -> None:
        """Answer ``route`` on ``url`` with ``handler(request, body)`` (``None``: pass through)."""
        self.intercepts[(url, route)] = handler

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        route = request.url.path.rsplit("/", 1)[-1]
        self.calls.append((url, route))
        self.called_at.append(time.time())
        if url in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if url in self.stopped:  # the request is in its socket; no answer until it runs again
            self.held.append((url, route, await request.aread()))
            await asyncio.Event().wait()
        if (url, route) in self.slow:
            await asyncio.sleep(self.slow[(url, route)])
        handler = self.intercepts.get((url, route))
        if handler is not None:
            body = json.loads(await request.aread() or b"{}")
            response = handler(request, body)
            if response is not None:
                return response
        return await self.apps[url].handle_async_request(request)

    def coordinator(self, journal: Journal | Path | None = None, **kw: Any) -> FleetCoordinator:
        kw.setdefault("initial_source", self.old)
        kw.setdefault("backoff_s", 0.001)
        kw.setdefault("cleanup_s", 10.0)
        return FleetCoordinator(self.urls, journal=journal, transport=self, **kw)

    def state(self, url: str) -> tuple[Any, ...]:
        snap = asyncio.run(self._status(url))
        return (snap["version"], snap["epoch"], snap["digest"], snap["paused"], snap["torn"])

    async def _status(self, url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(transport=self.apps[url], base_url=url) as client:
            reply: dict[str, Any] = (await client.post("/engine/get_weight_version", json={})).json()
            return reply

    def serving(self) -> set[tuple[Any, ...]]:
        """(version, epoch, digest) of every serving worker."""
        out = set()
        for url in self.urls:
            v, e, d, paused, torn = self.state(url)
            if not paused and not torn:
                out.add((v, e, d))
        return out


def refuse(code: str = "digest_mismatch", status: int = 409) -> Intercept:
    def handler(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(
            status, json={"status": "error", "code": code, "message": "refused by the test"}
        )

    return handler


def ok_without_doing_it(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(
        200, json={"status": "ok", "version": body.get("weight_version"), "version_declared": True}
    )
