"""What the coordinator says as it goes: one :class:`Event` per step, as it happens."""

from __future__ import annotations

import datetime
import time
from typing import Any, Protocol

import attrs

__all__ = ["Emit", "Event", "short_digest"]


@attrs.frozen
class Event:
    """One step as it happens: a phase change (``worker`` is None), a worker's step, or a
    heartbeat (``what == "waiting"``, ``detail`` naming the workers still owed an answer)."""

    phase: str
    worker: str | None
    what: str
    detail: str = ""
    at: float = attrs.field(factory=time.time)
    duration_s: float | None = None

    def line(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.at)) + f".{int(self.at % 1 * 1000):03d}"
        took = f" in {self.duration_s:.2f}s" if self.duration_s is not None else ""
        who = self.worker or "fleet"
        return f"{stamp} [{self.phase}] {who}: {self.what}{took}" + (
            f" ({self.detail})" if self.detail else ""
        )

    def to_log(self) -> dict[str, Any]:
        """The step as a JSON log line's fields (the shape of ``--log-format json`` lines)."""
        return {
            "ts": datetime.datetime.fromtimestamp(self.at, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": "INFO",
            "logger": "weightsync.fleet",
            "message": self.line(),
            "event": self.what,
            "phase": self.phase,
            "worker": self.worker,
            "detail": self.detail,
            "seconds": None if self.duration_s is None else round(self.duration_s, 3),
        }


class Emit(Protocol):
    """Say one step as it happens (the coordinator hands it to its ``on_event``)."""

    def __call__(
        self, phase: str, worker: str | None, what: str, detail: str = "", took: float | None = None
    ) -> None: ...


def short_digest(digest: Any) -> str:
    """A digest cut to 12 characters for a note (``"unknown"`` when there is none)."""
    return str(digest)[:12] if digest else "unknown"
