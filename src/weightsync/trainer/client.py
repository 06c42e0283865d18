"""Typed clients for a worker's admin routes: :class:`WorkerClient` (sync) and
:class:`AsyncWorkerClient` (async), both on httpx.

Each admin route is one method, generated from a signature
(:mod:`weightsync.trainer.route_methods`).  An error reply raises the matching
:mod:`weightsync.core.errors` class, with the server's ``code`` and ``message``
(:func:`~weightsync.trainer.wire.raise_for_reply`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import Awaitable
from typing import Any

import httpx

from weightsync.core import errors
from weightsync.trainer.replies import RoutesReply
from weightsync.trainer.route_methods import UNSET, RouteMethods, route
from weightsync.trainer.wire import (
    NODELAY,
    Reply,
    async_transport,
    check_url,
    decode,
    decode_completion,
    headers,
    raise_for_reply,
    sync_transport,
)

__all__ = [
    "NODELAY", "UNSET", "AsyncWorkerClient", "ClientPool", "Reply", "RouteMethods", "WorkerClient",
    "async_transport", "raise_for_reply", "route", "sync_transport",
]  # fmt: skip


class WorkerClient(RouteMethods[Reply]):
    """Blocking client for one worker.  ``base_url`` like ``http://127.0.0.1:8000`` (one
    without a scheme is refused, ``InvalidRequest`` ``bad_worker_url``); ``api_key`` is sent
    as a bearer token; ``timeout`` bounds each call in seconds.  Use ``with`` or
    :meth:`close`.  Every admin route is a method returning the worker's ok reply."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = check_url(base_url)
        self.http = httpx.Client(
            base_url=self.base_url, headers=headers(api_key), timeout=timeout, transport=sync_transport()
        )

    def _call(self, route: str, body: Reply) -> Reply:
        return decode(self.http.post(f"/engine/{route}", json=body))

    def routes(self) -> RoutesReply:
        """The admin routes the worker serves, its engine's name and world size."""
        return decode(self.http.get("/engine/routes"))  # type: ignore[return-value]

    def complete(self, prompt: str | list[int], **options: Any) -> Reply:
        """``POST /v1/completions`` with ``prompt`` (text or token ids) and OpenAI-style
        ``options`` (``max_tokens``, ``temperature`` …); returns the completion object, whose
        choices carry the weight version that produced them.  Raises the error family."""
        response = self.http.post("/v1/completions", json={"prompt": prompt, **options})
        return decode_completion(response)

    def close(self) -> None:
        """Close the client's connections."""
        self.http.close()

    def __enter__(self) -> WorkerClient:
        """The client itself; closed when the ``with`` block ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the client."""
        self.close()


class AsyncWorkerClient(RouteMethods[Awaitable[Reply]]):
    """Async client for one worker (use ``async with`` or ``await client.aclose()``).

    ``retries``: how many times a request that could not *connect* is sent again (it never
    reached the worker, so even a load is safe to resend), after ``backoff_s``, doubling up
    to ``max_backoff_s``.  :meth:`within` gives a view bounded by a deadline: every call then
    waits at most until it, and no retry starts that could not finish before it.  A call
    raises the worker's refusal, or ``EngineUnavailable`` with code ``unreachable`` (no
    connection, or it was lost) or ``timeout`` (no answer in time); its ``details["sent"]``
    is ``False`` when the request never left (no connection was made, or no time was left).  ``transport``: any httpx async
    transport (``httpx.ASGITransport`` over a worker app runs it in-process).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        retries: int = 0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
    ) -> None:
        self.base_url = check_url(base_url)
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.deadline: float | None = None  # time.monotonic() value
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers(api_key),
            timeout=timeout,
            transport=transport or async_transport(),
        )

    def within(self, deadline: float | None) -> AsyncWorkerClient:
        """This client (same connections) with every call bounded by ``deadline``, a
        :func:`time.monotonic` value (``None``: only the client's timeout)."""
        view = copy.copy(self)
        view.deadline = deadline
        return view

    def _left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    async def _post(self, route: str, body: Reply) -> Reply:
        attempt = 0
        while True:
            left = self._left()
            if left is not None and left <= 0:
                raise errors.EngineUnavailable(
                    f"{self.base_url}: no time left for {route}",
                    code="timeout",
                    url=self.base_url,
                    sent=False,
                )
            timeout = self.timeout if left is None else min(self.timeout, left)
            try:
                response = await asyncio.wait_for(
                    self.http.post(f"/engine/{route}", json=body, timeout=timeout), timeout
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                backoff = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                left = self._left()
                if attempt >= self.retries or (left is not None and backoff >= left):
                    raise errors.EngineUnavailable(
                        f"{self.base_url}: {route}: {exc or type(exc).__name__} "
                        f"(after {attempt + 1} attempt(s))",
                        code="unreachable",
                        url=self.base_url,
                        sent=False,  # no connection was made: it can never reach the worker
                    ) from None
                attempt += 1
                await asyncio.sleep(backoff)
                continue
            except (httpx.TimeoutException, asyncio.TimeoutError):
                raise errors.EngineUnavailable(
                    f"{self.base_url}: {route} did not answer in time", code="timeout", url=self.base_url
                ) from None
            except httpx.HTTPError as exc:
                raise errors.EngineUnavailable(
                    f"{self.base_url}: {route}: {exc!r}", code="unreachable", url=self.base_url
                ) from None
            return decode(response)

    def _call(self, route: str, body: Reply) -> Awaitable[Reply]:
        return self._post(route, body)

    async def routes(self) -> RoutesReply:
        """The admin routes the worker serves, its engine's name and world size."""
        return decode(await self.http.get("/engine/routes"))  # type: ignore[return-value]

    async def complete(self, prompt: str | list[int], **options: Any) -> Reply:
        """``POST /v1/completions`` with ``prompt`` (text or token ids) and OpenAI-style
        ``options``; returns the completion object.  Raises the error family."""
        response = await self.http.post("/v1/completions", json={"prompt": prompt, **options})
        return decode_completion(response)

    async def aclose(self) -> None:
        """Close the client's connections (every :meth:`within` view shares them)."""
        await self.http.aclose()

    async def __aenter__(self) -> AsyncWorkerClient:
        """The client itself; closed when the ``async with`` block ends."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the client."""
        await self.aclose()


class ClientPool:
    """One :class:`AsyncWorkerClient` per URL, made once per event loop and kept until
    :meth:`aclose` (a fresh httpx client costs tens of milliseconds, more on a loaded
    machine, and a new connection: a pusher keeps its clients from connect to close).

    Connections belong to the loop that opened them: :meth:`get` called from another loop
    closes the old clients (quietly, their loop may be gone) and makes new ones.
    ``transport``: the clients' httpx async transport (``None``: HTTP)."""

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.urls, self.api_key, self.timeout, self.transport = list(urls), api_key, timeout, transport
        self._made: tuple[asyncio.AbstractEventLoop, list[AsyncWorkerClient]] | None = None

    async def get(self) -> list[AsyncWorkerClient]:
        """The clients, in the order of ``urls``, for the running loop."""
        loop = asyncio.get_running_loop()
        if self._made is not None and self._made[0] is not loop:
            await self.aclose()
        if self._made is None:
            clients = [
                AsyncWorkerClient(u, api_key=self.api_key, timeout=self.timeout, transport=self.transport)
                for u in self.urls
            ]
            self._made = (loop, clients)
        return self._made[1]

    async def aclose(self) -> None:
        """Close the clients (the next :meth:`get` makes new ones)."""
        made, self._made = self._made, None
        if made is not None:
            with contextlib.suppress(Exception):  # a client of another, closed loop
                await asyncio.gather(*(c.aclose() for c in made[1]))
