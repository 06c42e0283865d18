"""Fleet operations through the router: an update (one coordinator transaction, batch by
batch, draining each batch from routing before it is paused and handing it back after it
committed), a relabel, and pause/resume of every worker — one operation at a time.

The coordinator runs each transaction on a thread of its own; :class:`Handoff` is its pair
of hooks, which cross back to the router's loop (where the routing state lives) to move a
batch out of routing and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

import httpx

from weightsync.core.errors import IllegalState, WeightSyncError
from weightsync.fleet.coordinator import FleetCoordinator
from weightsync.fleet.result import ROUTER_STEPS, TransactionResult
from weightsync.router import logs
from weightsync.router._state import OWNED
from weightsync.router.answers import Answer, FleetBusy, Reply, WorkerFailed, error_answer
from weightsync.router.metrics import RouterMetrics
from weightsync.router.poller import MAX_POLL_TIMEOUT_S, Poller, committed_row
from weightsync.router.view import FleetView

__all__ = ["FleetOperations", "Handoff"]


class Handoff:
    """A rolling update's hand-off of each batch between routing and the coordinator: the
    coordinator's ``before_pause`` and ``after_commit`` hooks, and the batch count."""

    def __init__(self, view: FleetView, poller: Poller, metrics: RouterMetrics) -> None:
        self.view = view
        self.poller = poller
        self.metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_by = 0.0  # when a drain stops waiting for requests in flight (the update's deadline)
        self._batches = self._batches_done = 0

    def begin(self, deadline_s: float, batches: int) -> None:
        """An update of ``batches`` batches starts on this loop, due within ``deadline_s``."""
        self._loop = asyncio.get_running_loop()
        self._drain_by = time.monotonic() + deadline_s
        self._batches, self._batches_done = batches, 0
        self.metrics.batches_total.set(batches)
        self.metrics.batches_done.set(0)

    async def before_pause(self, urls: Sequence[str]) -> None:
        """Before the coordinator pauses a batch: take ``urls`` out of routing and wait
        (until the update's deadline) for the requests already sent to them to finish."""
        await self._on_router_loop(self._drain, urls)

    async def after_commit(self, urls: Sequence[str]) -> None:
        """After a batch committed and resumed (or was rolled back): hand ``urls`` back to
        the poller with the journal's newest commits, and poll them now."""
        await self._on_router_loop(self._release, urls)

    async def _on_router_loop(
        self, step: Callable[[list[str]], Coroutine[Any, Any, None]], urls: Sequence[str]
    ) -> None:
        # Called from the coordinator's thread: the routing state belongs to the router's loop.
        assert self._loop is not None, "no update began"
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(step(list(urls)), self._loop))

    async def _drain(self, urls: list[str]) -> None:
        logs.emit("batch_draining", workers=urls, batch=self._batches_done + 1, batches=self._batches)
        self.view.act(urls, "drain")
        while self.view.in_flight(urls) and time.monotonic() < self._drain_by:
            await asyncio.sleep(0.005)
        self.view.act(urls, "update")

    async def _release(self, urls: list[str]) -> None:
        self.poller.refresh_committed()
        self.view.act(urls, "release")
        await self.poller.poll(urls)
        self._batches_done = min(self._batches_done + 1, self._batches)
        self.metrics.batches_done.set(self._batches_done)
        logs.emit("batch_returned", workers=urls, batch=self._batches_done, batches=self._batches)


class FleetOperations:
    """Fleet operations over ``coordinator``'s workers, one at a time under ``lock``.

    ``handoff`` must be the coordinator's hooks; fleet-wide posts go through ``poller``'s
    client, and what each operation leaves out of routing goes back to ``poller``.
    ``follows``: another writer keeps the journal, so no update or relabel runs here.
    """

    def __init__(
        self,
        coordinator: FleetCoordinator,
        view: FleetView,
        poller: Poller,
        metrics: RouterMetrics,
        handoff: Handoff,
        lock: asyncio.Lock,
        follows: bool = False,
    ) -> None:
        self.coordinator = coordinator
        self.follows = follows
        self.urls = coordinator.workers
        self.view = view
        self.poller = poller
        self.metrics = metrics
        self.handoff = handoff
        self.lock = lock
        self.last_update: Reply | None = None

    async def _exclusive(self, work: Callable[[], Awaitable[Answer]]) -> Answer:
        if self.lock.locked():
            return error_answer(FleetBusy("another fleet operation is running; try again when it ends"))
        async with self.lock:
            return await work()

    async def update(self, args: Mapping[str, Any]) -> Answer:
        """``/fleet/update_weights_from_disk`` with validated ``args``: one fleet transaction,
        in batches of ``max_unavailable`` workers.  409 ``journal_followed`` when another
        writer keeps the journal."""
        if self.follows:
            return _followed()

        async def work() -> Answer:
            k = args["max_unavailable"] or len(self.urls)
            self.handoff.begin(args["deadline_s"], math.ceil(len(self.urls) / k))
            self.metrics.updating.set(1)
            try:
                result = await _in_thread(
                    lambda: self.coordinator.update(
                        args["model_path"],
                        args["weight_version"],
                        policy=args["policy"],
                        min_workers=args["min_workers"],
                        max_unavailable=k,
                        pause_mode=args["pause_mode"],
                        deadline_s=args["deadline_s"],
                        expected_digest=args["expected_digest"],
                    )
                )
            finally:
                self.metrics.updating.set(0)
                # Whatever the transaction left out of routing (a fenced worker, a failure
                # between the hooks) goes back to the poller, which decides.
                owned = [u for u in self.urls if self.view.workers[u].state in OWNED]
                self.poller.refresh_committed()
                self.view.act(owned, "release")
                await self.poller.poll()
                with contextlib.suppress(WeightSyncError):
                    self.poller.renew_lease(now=True)
            return self._update_answer(result)

        return await self._exclusive(work)

    def _update_answer(self, result: TransactionResult) -> Answer:
        # The router holds the journal's lease: its advice names its own routes.
        out = result.to_json(ROUTER_STEPS)
        logs.emit(
            "update_done",
            txn=result.txn,
            phase=result.phase,
            committed=result.committed,
            version=result.version,
            code=result.code,
            next_step=out["next_step"],
        )
        self.last_update = out
        code = "ok" if result.committed else result.code or "failed"
        self.metrics.updates.labels(code).inc()
        if result.committed:
            return Answer(200, {"status": "ok", **out})
        status = 409 if result.phase == "aborted" else 502
        message = result.message or f"the transaction ended {result.phase}"
        return Answer(status, {**out, "status": "error", "code": code, "message": message})

    async def set_version(self, version: Any) -> Answer:
        """``/fleet/set_weight_version``: label the committed weights ``version`` under a new
        epoch, as one transaction that reloads each worker's committed checkpoint (so the
        digest is attested again).  409 ``no_committed_source`` when the journal names no
        checkpoint for some worker (a baseline adopted from the workers has none), and
        ``journal_followed`` when another writer keeps the journal."""
        if self.follows:
            return _followed()
        rows = {u: committed_row(self.coordinator.journal.committed(u)) for u in self.urls}
        missing = [u for u, row in rows.items() if not (row and row.get("source"))]
        if missing:
            return error_answer(
                IllegalState(
                    f"the journal names no committed checkpoint for {missing}: run "
                    "/fleet/update_weights_from_disk with a checkpoint and this version instead",
                    code="no_committed_source",
                )
            )
        paths = {u: str(row["source"]) for u, row in rows.items() if row}
        args = {
            "model_path": paths, "weight_version": version, "policy": "rollback", "min_workers": None,
            "pause_mode": "keep", "deadline_s": 600.0, "max_unavailable": len(self.urls),
            "expected_digest": None,
        }  # fmt: skip
        return await self.update(args)

    async def pause(self, mode: str, clear_cache: bool) -> Answer:
        async def work() -> Answer:
            self.view.act(self.urls, "pause")
            return await self._each("pause_generation", {"mode": mode, "clear_cache": clear_cache})

        return await self._exclusive(work)

    async def resume(self) -> Answer:
        async def work() -> Answer:
            answer = await self._each("resume_generation", {})
            self.view.act(self.urls, "resume")
            await self.poller.poll()
            return answer

        return await self._exclusive(work)

    async def flush(self) -> Answer:
        """Every worker's ``flush_cache`` (SGLang's fleet-wide ``/flush_cache``)."""
        return await self._exclusive(lambda: self._each("flush_cache", {}))

    async def _each(self, route: str, body: Reply) -> Answer:
        """POST ``route`` to every worker (bounded); the per-worker outcome, 502 if any failed."""
        client = self.poller.client
        payload = json.dumps(body).encode()

        async def one(url: str) -> Reply:
            try:
                response = await client.post(
                    f"{url}/engine/{route}", content=payload, timeout=MAX_POLL_TIMEOUT_S * 2
                )
                reply = response.json()
            except httpx.HTTPError as exc:
                return {"url": url, "ok": False, "code": _error_code(exc), "message": repr(exc)[:200]}
            except ValueError:
                return {"url": url, "ok": False, "code": "bad_reply", "message": "not JSON"}
            if isinstance(reply, dict) and reply.get("status") == "ok":
                return {"url": url, "ok": True}
            code = reply.get("code") if isinstance(reply, dict) else None
            message = reply.get("message") if isinstance(reply, dict) else None
            return {"url": url, "ok": False, "code": code or "bad_reply", "message": message}

        workers = list(await asyncio.gather(*(one(u) for u in self.urls)))
        bad = [w for w in workers if not w["ok"]]
        if not bad:
            return Answer(200, {"status": "ok", "workers": workers})
        exc = WorkerFailed(
            f"{route} failed on {len(bad)} of {len(workers)} workers: "
            + ", ".join(f"{w['url']}: {w['code']}" for w in bad)
        )
        return error_answer(exc, workers=workers)


def _followed() -> Answer:
    return error_answer(
        IllegalState(
            "this router follows a journal another writer keeps (--follow-journal): run fleet "
            "updates with that writer (its RayFleet, or weightsync fleet update)",
            code="journal_followed",
        )
    )


async def _in_thread(run: Callable[[], Awaitable[TransactionResult]]) -> TransactionResult:
    """Run a coordinator call on an event loop of its own, in a thread: whatever it does
    synchronously (hash a checkpoint, write the journal) never stalls routing."""

    async def awaited() -> TransactionResult:
        return await run()

    return await asyncio.to_thread(lambda: asyncio.run(awaited()))


def _error_code(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return "unreachable"
