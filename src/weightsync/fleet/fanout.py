"""The coordinator's reach: one client per worker, and one script per worker played on
every worker at once.

:class:`Fanout` sends each :class:`~weightsync.fleet.calls.Call` a script yields to its
worker (bounded by the transaction's deadline, connection failures retried) and sends the
reply back in, or throws the error in at the same point; every other step a script yields
goes to the caller's ``aside``, except :class:`~weightsync.fleet.clocks.ReadClock` and
:class:`~weightsync.fleet.clocks.Expires`, which it answers itself: it times each read of a
worker's ``clock`` and keeps its latest reading (:mod:`weightsync.fleet.clocks`).

What it says, in order: each worker's own lines as its script makes them, then one line
counting the answers once every worker's script ended (so a count never comes before a
line it counts).  While a step waits, a progress line (``waiting``) names who is still
owed an answer and the time left: every :data:`PROGRESS_S` during the step's first
``heartbeat_s``, then every ``heartbeat_s`` — no step is silent for more than a second
before anyone knows what it waits for, and a long one is not a flood.  Each progress line
also renews the coordinator's lease (``beat``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Final, TypeVar

import attrs
import httpx

from weightsync.core.errors import WeightSyncError
from weightsync.fleet import clocks
from weightsync.fleet.calls import Call, Script, Step
from weightsync.fleet.clocks import Expires, ReadClock
from weightsync.fleet.events import Emit
from weightsync.trainer.client import AsyncWorkerClient

__all__ = ["PROGRESS_S", "Aside", "Fanout", "Transport", "failure"]

PROGRESS_S: Final = 1.0
"""How long a step may run before its first progress line (and the interval between its
lines until ``heartbeat_s`` has passed)."""

T = TypeVar("T")
Transport = httpx.AsyncBaseTransport | Callable[[str], httpx.AsyncBaseTransport] | None
Aside = Callable[[Step], Awaitable[Any]]
"""What a driver does with a step that is not a call (a note, a re-push): its value is sent
back into the script."""


def failure(url: str, exc: Exception) -> WeightSyncError:
    """``exc``, a worker's script's failure, as the error :meth:`Fanout.play` reports: itself
    when it is the family's, else ``coordinator_error`` (the coordinator failed locally)."""
    if isinstance(exc, WeightSyncError):
        return exc
    return WeightSyncError(
        f"{url}: the coordinator failed locally: {type(exc).__name__}: {exc}",
        code="coordinator_error",
        url=url,
    )


async def _no_aside(step: Step) -> Any:
    raise TypeError(f"this fan-out makes calls only, not {step!r}")


@attrs.define(kw_only=True)
class Fanout:
    """Clients, concurrent scripts and progress lines.  ``emit`` says each step as it happens;
    ``beat`` is called at every progress line while a step waits."""

    api_key: str | None
    transport: Transport
    retries: int
    backoff_s: float
    max_backoff_s: float
    heartbeat_s: float
    emit: Emit
    beat: Callable[[], None]
    progress_s: float = PROGRESS_S
    _clients: dict[str, AsyncWorkerClient] = attrs.field(factory=dict, init=False)
    _clocks: dict[str, clocks.Reading] = attrs.field(factory=dict, init=False)

    def client(self, url: str, deadline: float | None) -> AsyncWorkerClient:
        """The worker's client, bounded by ``deadline`` (a ``time.monotonic()`` value)."""
        if url not in self._clients:
            t = self.transport(url) if callable(self.transport) else self.transport
            self._clients[url] = AsyncWorkerClient(
                url,
                api_key=self.api_key,
                transport=t,
                retries=self.retries,
                backoff_s=self.backoff_s,
                max_backoff_s=self.max_backoff_s,
            )
        return self._clients[url].within(deadline)

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        self._clocks.clear()
        await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)

    async def send(self, call: Call, deadline: float) -> Any:
        """Make ``call``: the worker client's method named by its route, with its body."""
        method = getattr(self.client(call.worker, deadline), call.route)
        return await method(**call.body)

    async def read_clock(self, url: str, deadline: float) -> clocks.Reading:
        """Read ``url``'s clock, timing the round trip, and keep the reading (one without a
        clock where the worker has no ``clock`` route).  Raises the worker's other errors."""
        sent = time.time()
        try:
            reply = await self.client(url, deadline).clock()
        except WeightSyncError as exc:
            if exc.code not in ("unknown_route", "not_found"):
                raise
            reply = {}
        self._clocks[url] = read = clocks.reading(reply, sent, time.time())
        return read

    async def expiry(self, step: Expires, deadline: float) -> clocks.Expiry:
        """The answer to ``step``: by the worker's latest reading, read again first when there
        is none or it is older than :data:`~weightsync.fleet.clocks.CLOCK_READ_S`."""
        read = self._clocks.get(step.worker)
        if read is None or time.time() - read.at > clocks.CLOCK_READ_S:
            read = await self.read_clock(step.worker, deadline)
        return clocks.expiry(step.deadline, read, time.time())

    async def _make(self, step: Call | ReadClock | Expires, deadline: float) -> Any:
        if isinstance(step, Call):
            return await self.send(step, deadline)
        if isinstance(step, ReadClock):
            await self.read_clock(step.worker, deadline)
            return None
        return await self.expiry(step, deadline)

    async def follow(self, script: Script[T], deadline: float, aside: Aside = _no_aside) -> T:
        """Play ``script`` to its end; its value.  Raises what the script raises."""
        answer: Any = None
        error: Exception | None = None
        while True:
            try:
                step = script.send(answer) if error is None else script.throw(error)
            except StopIteration as stop:
                value: T = stop.value
                return value
            answer, error = None, None
            try:
                if isinstance(step, Call | ReadClock | Expires):
                    answer = await self._make(step, deadline)
                else:
                    answer = await aside(step)
            except Exception as exc:  # thrown in where the script asked: it may handle it
                error = exc

    def _interval(self, elapsed: float) -> float:
        """Seconds from a progress line to the next, ``elapsed`` into the step."""
        first = min(self.progress_s, self.heartbeat_s)
        return first if elapsed < self.heartbeat_s else self.heartbeat_s

    async def waiting(
        self,
        phase: str,
        pending: Collection[asyncio.Future[Any]],
        until: float,
        owed: Callable[[set[asyncio.Future[Any]]], str],
        *,
        deadline: float | None = None,
    ) -> set[asyncio.Future[Any]]:
        """Wait for ``pending`` until every one is done or ``until`` (a ``time.monotonic()``
        value) comes, with a progress line while it waits: ``owed(still pending)`` and the time
        left before ``deadline`` (default ``until``).  Returns those still pending."""
        started = time.monotonic()
        left: set[asyncio.Future[Any]] = set(pending)
        while left:
            now = time.monotonic()
            if now >= until:
                break
            _, left = await asyncio.wait(left, timeout=min(self._interval(now - started), until - now))
            if left and time.monotonic() < until:
                self.beat()  # a long step keeps the lease alive
                remaining = max(0.0, (until if deadline is None else deadline) - time.monotonic())
                self.emit(phase, None, "waiting", f"{owed(left)}; {remaining:.0f}s left")
        return left

    async def play(
        self,
        phase: str,
        scripts: Mapping[str, Script[T]],
        deadline: float,
        aside: Aside = _no_aside,
        *,
        step: str = "",
    ) -> tuple[dict[str, T], dict[str, WeightSyncError]]:
        """Play each worker's script at once; each one's value and each one's error, by URL
        (an error that is not the worker's reads as ``coordinator_error``).  ``step`` names
        what was played on the line that counts the answers."""
        started = time.monotonic()
        tasks = {u: asyncio.ensure_future(self.follow(s, deadline, aside)) for u, s in scripts.items()}

        def owed(left: set[asyncio.Future[Any]]) -> str:
            names = [u for u, t in tasks.items() if t in left]
            return f"{len(tasks) - len(names)}/{len(tasks)} answered, {len(names)} owed: {', '.join(names)}"

        await self.waiting(phase, tasks.values(), math.inf, owed, deadline=deadline)
        done: dict[str, T] = {}
        failed: dict[str, WeightSyncError] = {}
        for url, task in tasks.items():
            exc = task.exception()
            if exc is None:
                done[url] = task.result()
            elif isinstance(exc, Exception):
                failed[url] = failure(url, exc)
            else:
                raise exc
        if scripts:
            took = time.monotonic() - started
            self.emit(phase, None, f"{len(done)}/{len(scripts)} answered", step, took=took)
        return done, failed
