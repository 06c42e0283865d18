"""Completion forwarding: pick a worker for each request under its freshness policy, send
it on, retry once elsewhere if the worker fails before answering, and label the reply with
the weights that served it."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import httpx

from weightsync.core.errors import WeightSyncError

from ._state import Label, canonical
from .answers import Answer, NoWorker, Reply, WorkerFailed, error_answer
from .metrics import RouterMetrics
from .policy import BODY_FIELDS, Policy, Refusal, choose
from .view import FleetView

__all__ = ["Forwarding"]


class Forwarding:
    """Routes completions (the attributes are set by :class:`~weightsync.router.service.Router`)."""

    view: FleetView
    metrics: RouterMetrics
    poll_interval_s: float
    _requests: httpx.AsyncClient | None

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
