"""The router's work, without HTTP framing: poll the workers, route completions, and run
fleet operations with the journal.

:class:`Router` owns one :class:`~weightsync.router.view.FleetView` (the decisions), one
HTTP client per purpose (polls never wait behind completions), and the fleet coordinator
that holds the journal: while the router runs it is the journal's one writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import httpx

from weightsync.core.errors import EngineUnavailable, IllegalState, WeightSyncError
from weightsync.fleet.coordinator import FleetCoordinator, worker_url
from weightsync.fleet.journal import Journal
from weightsync.fleet.result import TransactionResult
from weightsync.trainer.client import async_transport

from ._state import OWNED, Label, canonical
from .metrics import RouterMetrics
from .policy import BODY_FIELDS, Policy, Refusal, choose
from .view import FleetView

Reply = dict[str, Any]

LEASE_S: Final = 30.0
"""How long the router's hold on the journal lasts unless renewed (the poller renews it)."""

MIN_POLL_TIMEOUT_S: Final = 1.0
MAX_POLL_TIMEOUT_S: Final = 5.0
"""A poll waits two poll intervals for a worker, but at least 1 s and at most 5 s: a worker
busy generating is slow to answer, not gone (a dead one refuses the connection at once)."""


@attrs.frozen
class Answer:
    """What the router answers one request with: a status, a JSON object, extra headers."""

    status: int
    body: Reply
    headers: Mapping[str, str] = attrs.field(factory=dict)


def error_answer(exc: WeightSyncError, headers: Mapping[str, str] | None = None, **extra: Any) -> Answer:
    return Answer(exc.http_status, {**exc.to_reply(), **extra}, dict(headers or {}))


class NoWorker(EngineUnavailable):
    """No worker qualifies for a request (503 with ``Retry-After``)."""

    default_code = "no_worker"


class WorkerFailed(WeightSyncError):
    """The worker(s) a request went to failed before returning anything (502)."""

    http_status = 502
    default_code = "worker_failed"


class FleetBusy(IllegalState):
    default_code = "fleet_busy"


class Router:
    """Routes completions over ``workers`` and runs fleet operations on them.

    ``journal``: a journal file (``None``: in memory).  ``worker_api_key``: the workers'
    bearer token.  ``default_policy``: for requests that set no bounds.
    """

    def __init__(
        self,
        workers: Sequence[str],
        *,
        journal: str | Path | None = None,
        worker_api_key: str | None = None,
        poll_interval_s: float = 0.5,
        default_policy: Policy | None = None,
        request_timeout_s: float = 600.0,
        initial_source: str | None = None,
    ) -> None:
        urls = [worker_url(u) for u in workers]
        self.coordinator = FleetCoordinator(
            urls, journal=Journal(journal) if journal else None, api_key=worker_api_key,
            initial_source=initial_source, before_pause=self._bridge(self._before_pause),
            after_commit=self._bridge(self._after_commit), lease_s=LEASE_S,
        )  # fmt: skip
        self.journal = self.coordinator.journal
        # The router is the journal's one writer while it runs: another coordinator (a
        # `weightsync fleet update` beside it) is refused with journal_locked.
        self.journal.acquire(LEASE_S)
        self._leased_at = time.monotonic()
        self.urls = self.coordinator.workers
        self.view = FleetView(self.urls, on_fence=self._fenced)
        self.metrics = RouterMetrics(self.view)
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = min(max(2 * poll_interval_s, MIN_POLL_TIMEOUT_S), MAX_POLL_TIMEOUT_S)
        self.default_policy = default_policy or Policy()
        self.request_timeout_s = request_timeout_s
        self._headers = {"content-type": "application/json"}
        if worker_api_key:
            self._headers["authorization"] = f"Bearer {worker_api_key}"
        self._requests: httpx.AsyncClient | None = None
        self._polls: httpx.AsyncClient | None = None
        self._poller: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admin = asyncio.Lock()
        self._batches = self._batches_done = 0
        self._drain_by = 0.0  # when a drain stops waiting for requests in flight (the update's deadline)
        self.last_update: Reply | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the clients, read the journal, poll once (adopting a baseline), start polling."""
        self._loop = asyncio.get_running_loop()
        # Before serving: an import running beside requests would hold the GIL under them.
        _warm_checkpoint_reader()
        # Idle connections are dropped before a worker's server would close them (uvicorn:
        # 5 s), so a request never races a server-side close on a reused connection.
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0)
        self._requests = httpx.AsyncClient(
            headers=self._headers, transport=async_transport(), limits=limits, timeout=self.request_timeout_s
        )
        self._polls = httpx.AsyncClient(
            headers=self._headers, transport=async_transport(), limits=httpx.Limits(keepalive_expiry=2.0)
        )
        self.refresh_committed()
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for client in (self._requests, self._polls):
            if client is not None:
                await client.aclose()
        with contextlib.suppress(WeightSyncError):
            self.journal.release()
        self.journal.close()

    def _fenced(self, url: str, why: str) -> None:
        self.metrics.fencings.labels(url, why).inc()

    # ------------------------------------------------------------------ polling

    def refresh_committed(self) -> None:
        self.view.load_journal({u: _row(self.journal.committed(u)) for u in self.urls})

    def _renew_lease(self, now: bool = False) -> None:
        # A transaction releases the lease when it ends: taking it again renews it too.  While
        # one runs (in its own thread) it holds and renews the lease itself.
        if self._admin.locked() and not now:
            return
        if now or time.monotonic() - self._leased_at > LEASE_S / 3:
            self.journal.acquire(LEASE_S)
            self._leased_at = time.monotonic()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            with contextlib.suppress(WeightSyncError):  # held elsewhere now: routing goes on
                self._renew_lease()
            try:
                await self.poll()
            except Exception:  # a poll must never stop polling
                await asyncio.sleep(self.poll_interval_s)

    async def _read(self, url: str) -> tuple[Reply | None, str | None]:
        assert self._polls is not None
        try:
            response = await asyncio.wait_for(
                self._polls.post(
                    f"{url}/engine/get_weight_version", content=b"{}", timeout=self.poll_timeout_s
                ),
                self.poll_timeout_s,
            )
            reply = response.json()
        except (httpx.TimeoutException, asyncio.TimeoutError):
            return None, "timeout"
        except httpx.HTTPError:
            return None, "unreachable"
        except ValueError:
            return None, "bad_reply"
        if not isinstance(reply, dict) or reply.get("status") != "ok" or response.status_code != 200:
            code = reply.get("code") if isinstance(reply, dict) else None
            return None, code if isinstance(code, str) else "bad_reply"
        return reply, None

    async def poll(self, urls: Sequence[str] | None = None) -> None:
        """Read every worker's state (bounded by the poll timeout) and apply what was seen."""
        urls = list(urls or self.urls)
        seqs = {u: self.view.workers[u].seq for u in urls}
        answers = await asyncio.gather(*(self._read(u) for u in urls))
        replies = {u: a[0] for u, a in zip(urls, answers, strict=True)}
        if self.view.baseline.source is None and len(urls) == len(self.urls):
            self.view.adopt(replies)
        for url, (reply, error) in zip(urls, answers, strict=True):
            self.view.observed(url, reply, seqs[url], error)

    # ------------------------------------------------------------------ completions

    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.poll_interval_s)))

    async def complete(self, body: Reply, policy: Policy, raw: bytes | None = None) -> Answer:
        """Route one completion: ``body`` is the request's JSON object, ``raw`` its bytes
        (forwarded as they are when the body has no freshness fields, which are dropped)."""
        assert self._requests is not None
        if raw is None or any(k in body for k in BODY_FIELDS):
            raw = json.dumps({k: v for k, v in body.items() if k not in BODY_FIELDS}).encode()
        payload = raw
        failed: list[str] = []
        for _ in range(2):
            candidates, start = self.view.candidates()
            pick = choose(candidates, policy, self.view.newest_epoch, exclude=frozenset(failed), start=start)
            if isinstance(pick, Refusal):
                return self._refuse(pick, failed)
            worker = self.view.workers[pick.url]
            worker.in_flight += 1
            try:
                response = await self._requests.post(f"{pick.url}/v1/completions", content=payload)
                reply = response.json()
            except httpx.HTTPError as exc:
                failed.append(pick.url)
                if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                    # Nobody is listening: out of routing now.  A connection that broke
                    # mid-request may be a dying worker or one dropped socket: the poller decides.
                    self.view.failed(pick.url, "unreachable")
                self.metrics.routed.labels(pick.url, "failed").inc()
                continue
            except ValueError:
                reply = None
            finally:
                worker.in_flight -= 1
            return self._relay(pick.url, pick.label, response.status_code, reply)
        gave_up = WorkerFailed(f"the worker(s) {failed} failed before returning anything", workers=failed)
        self.metrics.refusals.labels(gave_up.code).inc()
        return error_answer(gave_up, worker=failed[-1])

    def _refuse(self, refusal: Refusal, failed: list[str]) -> Answer:
        if failed:  # nobody else qualifies for the retry
            exc: WeightSyncError = WorkerFailed(
                f"{failed[0]} failed before returning anything, and no other worker qualifies "
                f"({refusal.message})",
                workers=failed,
            )
            self.metrics.refusals.labels(exc.code).inc()
            return error_answer(exc, worker=failed[0])
        self.metrics.refusals.labels(refusal.code).inc()
        message = refusal.message
        if refusal.code == "no_worker":
            states = Counter(w.state for w in self.view.workers.values())
            message = (
                "no worker is routable now (" + ", ".join(f"{n} {s}" for s, n in sorted(states.items())) + ")"
            )
        return error_answer(NoWorker(message, code=refusal.code), {"retry-after": self.retry_after()})

    def _relay(self, url: str, sent: Label, status: int, reply: Any) -> Answer:
        if not isinstance(reply, dict):
            self.metrics.routed.labels(url, "worker_error").inc()
            exc = WorkerFailed(f"{url} answered HTTP {status} without a JSON object", code="bad_reply")
            return error_answer(exc, worker=url)
        reply["worker"] = url
        if status >= 400:
            self.metrics.routed.labels(url, "worker_error").inc()
            return Answer(status, reply)
        self.metrics.routed.labels(url, "ok").inc()
        epoch = self._served_epoch(url, sent, reply)
        reply["weight_epoch"] = epoch
        headers = {
            "x-weightsync-weight-version": canonical(reply.get("weight_version")),
            "x-weightsync-weight-epoch": "null" if epoch is None else str(epoch),
        }
        return Answer(status, reply, headers)

    def _served_epoch(self, url: str, sent: Label, reply: Reply) -> int | None:
        """The fleet epoch of the version the reply names: the one the worker had when the
        request was sent, else the one it has now; ``None`` when neither label matches."""
        declared = reply.get("weight_version_declared") is True
        version = canonical(reply.get("weight_version"))
        for label in (sent, self.view.workers[url].label):
            if label is not None and label.declared == declared and canonical(label.version) == version:
                return label.epoch
        return None

    # ------------------------------------------------------------------ fleet operations

    async def _exclusive(self, work: Callable[[], Awaitable[Answer]]) -> Answer:
        if self._admin.locked():
            return error_answer(FleetBusy("another fleet operation is running; try again when it ends"))
        async with self._admin:
            return await work()

    def _bridge(
        self, hook: Callable[[Sequence[str]], Coroutine[Any, Any, None]]
    ) -> Callable[[Sequence[str]], Awaitable[None]]:
        """``hook`` as the coordinator calls it from its own thread: run on the router's loop
        (which owns the routing state), awaited there."""

        async def bridged(urls: Sequence[str]) -> None:
            assert self._loop is not None
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(hook(list(urls)), self._loop))

        return bridged

    async def _transaction(self, run: Callable[[], Awaitable[TransactionResult]]) -> TransactionResult:
        """Run a coordinator call on an event loop of its own, in a thread: whatever it does
        synchronously (hash a checkpoint, write the journal) never stalls routing."""
        return await asyncio.to_thread(lambda: asyncio.run(_awaited(run)))

    async def _before_pause(self, urls: Sequence[str]) -> None:
        """The coordinator's hook before it pauses a batch: take ``urls`` out of routing and
        wait (until the update's deadline) for the requests already sent to them to finish."""
        self.view.act(urls, "drain")
        while self.view.in_flight(urls) and time.monotonic() < self._drain_by:
            await asyncio.sleep(0.005)
        self.view.act(urls, "update")

    async def _after_commit(self, urls: Sequence[str]) -> None:
        """The coordinator's hook after a batch committed and resumed (or was rolled back):
        hand ``urls`` back to the poller with the journal's newest commits, and poll them now."""
        self.refresh_committed()
        self.view.act(urls, "release")
        await self.poll(urls)
        self._batches_done = min(self._batches_done + 1, self._batches)
        self.metrics.batches_done.set(self._batches_done)

    async def update(self, args: Mapping[str, Any]) -> Answer:
        """``/fleet/update_weights_from_disk`` with validated ``args``: one fleet transaction,
        in batches of ``max_unavailable`` workers."""

        async def work() -> Answer:
            k = args["max_unavailable"] or len(self.urls)
            self._drain_by = time.monotonic() + args["deadline_s"]
            self._batches, self._batches_done = math.ceil(len(self.urls) / k), 0
            self.metrics.batches_total.set(self._batches)
            self.metrics.batches_done.set(0)
            self.metrics.updating.set(1)
            try:
                result = await self._transaction(lambda: self.coordinator.update(
                    args["model_path"], args["weight_version"], policy=args["policy"],
                    min_workers=args["min_workers"], max_unavailable=k, pause_mode=args["pause_mode"],
                    deadline_s=args["deadline_s"], expected_digest=args["expected_digest"],
                ))  # fmt: skip
            finally:
                self.metrics.updating.set(0)
                # Whatever the transaction left out of routing (a fenced worker, a failure
                # between the hooks) goes back to the poller, which decides.
                owned = [u for u in self.urls if self.view.workers[u].state in OWNED]
                self.refresh_committed()
                self.view.act(owned, "release")
                await self.poll()
                with contextlib.suppress(WeightSyncError):
                    self._renew_lease(now=True)
            return self._update_answer(result)

        return await self._exclusive(work)

    def _update_answer(self, result: TransactionResult) -> Answer:
        out = result.to_json()
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
        checkpoint for some worker (a baseline adopted from the workers has none)."""
        rows = {u: _row(self.journal.committed(u)) for u in self.urls}
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
            await self.poll()
            return answer

        return await self._exclusive(work)

    async def _each(self, route: str, body: Reply) -> Answer:
        """POST ``route`` to every worker (bounded); the per-worker outcome, 502 if any failed."""
        client = self._polls
        assert client is not None
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

    def status(self) -> Reply:
        return {"status": "ok", **self.view.status(), "last_update": self.last_update}


def _warm_checkpoint_reader() -> None:
    """Load what a transaction uses to hash a checkpoint here (the trainer's checkpoint
    reader, torch under it), so the first update does not spend seconds importing it while
    the fleet waits in prepare.  Without the torch extra there is nothing to load: the
    transaction then takes the digest from the workers' dry runs."""
    with contextlib.suppress(ImportError):
        import weightsync.trainer.checkpoint  # noqa: F401


async def _awaited(run: Callable[[], Awaitable[TransactionResult]]) -> TransactionResult:
    return await run()


def _row(row: Any) -> dict[str, Any] | None:
    """A journal's committed row as a plain mapping (``source``, ``version``, ``epoch``, ``digest``)."""
    if row is None:
        return None
    return {k: getattr(row, k) for k in ("source", "version", "epoch", "digest")}


def _error_code(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return "unreachable"
