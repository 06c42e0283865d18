"""What the router answers a request with, and the refusals that are its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from weightsync.core.errors import EngineUnavailable, IllegalState, WeightSyncError

__all__ = ["Answer", "FleetBusy", "NoWorker", "Reply", "WorkerFailed", "error_answer"]

Reply = dict[str, Any]


@attrs.frozen
class Answer:
    """What the router answers one request with: a status, a JSON object, extra headers, and
    optionally ``raw``, the object's bytes as they are sent (else ``body`` is dumped)."""

    status: int
    body: Reply
    headers: Mapping[str, str] = attrs.field(factory=dict)
    raw: bytes | None = None


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
