"""What the router did, as log records on ``weightsync.router``: every fencing, admission
(a worker back in routing), rolling batch, transaction step and rollback at INFO, and the
refusals of completions — at most one line a second per reason, with how many it stands
for, so a fleet that refuses under load never floods the log.

A record's message reads as one line (``fenced worker='http://…' why='reply_mismatch'``);
its fields ride on the record as ``record.event``, which ``--log-format json`` writes out
as keys of their own (see :mod:`weightsync.edge.logs`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

from weightsync.fleet.events import Event

log = logging.getLogger("weightsync.router")

REFUSAL_EVERY_S: Final = 1.0
"""Refusals of one reason are logged at most once in this many seconds (with a count)."""


def emit(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one router event with its fields."""
    if log.isEnabledFor(level):
        text = " ".join(f"{k}={v!r}" for k, v in fields.items())
        log.log(level, "%s %s", event, text, extra={"event": {"event": event, **fields}})


def transaction_step(event: Event) -> None:
    """A step of a fleet transaction the router runs (the coordinator's ``on_event``);
    heartbeats (``waiting``) are left out."""
    if event.what == "waiting":
        return
    fields: dict[str, Any] = {"phase": event.phase, "what": event.what}
    if event.worker is not None:
        fields["worker"] = event.worker
    if event.detail:
        fields["detail"] = event.detail
    if event.duration_s is not None:
        fields["seconds"] = round(event.duration_s, 3)
    emit("rollback" if "roll" in event.phase or "roll" in event.what else "transaction", **fields)


class Refusals:
    """Logs the router's own refusals of completions, one line per reason per second."""

    def __init__(self, every_s: float = REFUSAL_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def note(self, code: str, message: str) -> None:
        now = time.monotonic()
        held = self._held.get(code, 0) + 1
        if now - self._last.get(code, -self.every_s) < self.every_s:
            self._held[code] = held
            return
        self._last[code], self._held[code] = now, 0
        emit("refused", code=code, count=held, message=message[:300])
