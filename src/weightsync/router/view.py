"""The router's view of its fleet: each worker's routing machine, last label and in-flight
count, and the label committed for it (from the journal, else the adopted baseline).

No I/O here: the poller and the routes feed observations and actions in, and read
candidates and status out.  Everything runs on the router's one event loop, so nothing
here needs a lock; every method returns without awaiting.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from weightsync.router._state import FENCED, Label, RoutingMachine, canonical, observe
from weightsync.router.policy import Candidate

BASELINE_SOURCES: Final = ("journal", "workers")
ANSWERED_BADLY: Final = frozenset({"bad_reply"})
"""Poll errors of a worker that answered, but not acceptably: it is fenced, not unreachable."""


def _taints(reply: Mapping[str, Any]) -> tuple[str, ...]:
    """The taints a ``get_weight_version`` reply names (none from a worker that reports none;
    anything but a list of strings counts as one taint, ``malformed``: not routed to)."""
    taints = reply.get("taints", [])
    if type(taints) is not list or any(type(t) is not str for t in taints):
        return ("malformed",)
    return tuple(sorted(set(taints)))


@attrs.define
class WorkerView:
    """One worker as the router sees it."""

    url: str
    machine: RoutingMachine = attrs.field(factory=RoutingMachine)
    label: Label | None = None  # what it last said it serves
    in_flight: int = 0  # requests the router sent it that have not finished
    seq: int = 0  # bumped by each router action: a poll sent before one is stale
    last_error: str | None = None
    why: str | None = None  # why it is fenced or unreachable (an observation, or an error code)
    taints: tuple[str, ...] = ()  # the routing taints it last reported (Dynamo's model_taints)
    since: float = attrs.field(factory=time.monotonic)

    @property
    def state(self) -> str:
        return self.machine.state


@attrs.frozen
class Baseline:
    """What the router took as committed before any transaction of its own."""

    source: str | None  # "journal", "workers", or None (nothing adopted yet)
    label: Label | None = None
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "label": None if self.label is None else self.label.to_json(),
            "message": self.message,
        }


JournalRow = Mapping[str, Any]


class FleetView:
    """Every worker's routing state; ``on_fence(url, why)`` sees each move into fencing,
    ``on_move(url, before, after, why)`` every change of state."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        on_fence: Callable[[str, str], None] | None = None,
        on_move: Callable[[str, str, str, str], None] | None = None,
    ) -> None:
        self.workers: dict[str, WorkerView] = {u: WorkerView(u) for u in urls}
        self.committed: dict[str, Label] = {}
        self.baseline = Baseline(None, message="waiting for the first poll")
        self.on_fence = on_fence
        self.on_move = on_move
        self._rr = itertools.count()

    # ------------------------------------------------------------------ committed labels

    def load_journal(self, rows: Mapping[str, JournalRow | None]) -> None:
        """Take the journal's committed rows (``Journal.committed(url)`` per worker).

        The first time any row exists, it is the baseline (``source: "journal"``); a worker
        without a row keeps the baseline label adopted from the workers, if any.
        """
        labels = {
            url: Label(True, row.get("version"), row.get("epoch"), row.get("digest"))
            for url, row in rows.items()
            if row is not None
        }
        if labels and self.baseline.source is None:
            newest = max(labels.values(), key=lambda lab: lab.epoch or 0)
            self.baseline = Baseline("journal", newest, "the journal's last committed state")
        fallback = self.baseline.label if self.baseline.source == "workers" else None
        self.committed = {}
        for url in self.workers:
            label = labels.get(url, fallback)
            if label is not None:
                self.committed[url] = label

    def adopt(self, replies: Mapping[str, Mapping[str, Any] | None]) -> bool:
        """Adopt the workers' agreed state as the baseline, when nothing is adopted yet and
        more than half of all workers run, untorn, on one label with a known digest.
        Returns whether a baseline is now adopted."""
        if self.baseline.source is not None:
            return True
        seen: Counter[tuple[Any, ...]] = Counter()
        labels: dict[tuple[Any, ...], Label] = {}
        for reply in replies.values():
            if reply is None or reply.get("torn") is not False or reply.get("paused") is not False:
                continue
            label = Label.from_reply(reply)
            if label.digest is not None and reply.get("update_in_flight") is False:
                key = (label.declared, canonical(label.version), label.epoch, label.digest)
                seen[key] += 1
                labels[key] = label
        if not seen:
            self.baseline = Baseline(None, message="no running worker reported a digest yet")
            return False
        key, count = seen.most_common(1)[0]
        label = labels[key]
        if count * 2 <= len(self.workers):
            self.baseline = Baseline(
                None,
                message=f"no state is shared by more than half of the workers ({count} of {len(self.workers)})",
            )
            return False
        self.baseline = Baseline(
            "workers", label, f"{count} of {len(self.workers)} running workers agree (no journal commit yet)"
        )
        self.committed = {u: self.committed.get(u, label) for u in self.workers}
        return True

    @property
    def newest_epoch(self) -> int:
        return max((lab.epoch or 0 for lab in self.committed.values()), default=0)

    @property
    def newest(self) -> Label | None:
        return max(self.committed.values(), key=lambda lab: lab.epoch or 0, default=None)

    # ------------------------------------------------------------------ moves

    def observed(self, url: str, reply: Mapping[str, Any] | None, seq: int, error: str | None = None) -> str:
        """Apply one poll's answer (``None`` when it failed with ``error``), unless a router
        action happened since the poll was sent (``seq`` is stale).  Returns the state."""
        worker = self.workers[url]
        if seq != worker.seq:
            return worker.state
        trigger = observe(reply, self.committed.get(url))
        if reply is None and error in ANSWERED_BADLY:
            trigger = "seen_uncommitted"
        if reply is not None:
            worker.label = Label.from_reply(reply)
            worker.taints = _taints(reply)
        worker.last_error = error if reply is None else None
        self._fire(worker, trigger, error or trigger)
        return worker.state

    def failed(self, url: str, error: str) -> None:
        """A request to ``url`` failed before any reply: out of routing until a poll says otherwise."""
        worker = self.workers[url]
        worker.last_error = error
        self._fire(worker, "lost", error)

    def mismatched(self, url: str, why: str) -> None:
        """A reply from ``url`` named weights its committed label does not describe: fenced
        at once, and a poll sent before this moment cannot route it again (only a later poll
        that sees it on its committed label does)."""
        worker = self.workers[url]
        worker.seq += 1
        worker.last_error = why
        self._fire(worker, "seen_uncommitted", why)

    def act(self, urls: Iterable[str], trigger: str) -> list[str]:
        """Fire a router action on ``urls``; return those it applied to (the others have no
        row for it and stay as they are)."""
        moved = []
        for url in urls:
            worker = self.workers[url]
            worker.seq += 1
            if self._fire(worker, trigger, trigger):
                moved.append(url)
        return moved

    def _fire(self, worker: WorkerView, trigger: str, why: str) -> bool:
        before = worker.state
        if not worker.machine.fire(trigger):
            return False
        if worker.state != before:
            worker.since = time.monotonic()
            if worker.state in FENCED:
                worker.why = why
                if self.on_fence is not None:
                    self.on_fence(worker.url, why)
            elif before in FENCED:
                worker.why = None
            if self.on_move is not None:
                self.on_move(worker.url, before, worker.state, why)
        return True

    # ------------------------------------------------------------------ reads

    def candidates(self) -> tuple[list[Candidate], int]:
        """The routable workers, and a round-robin start index for :func:`~.policy.choose`."""
        out = [
            Candidate(w.url, w.label, w.in_flight)
            for w in self.workers.values()
            if w.machine.routable and w.label is not None and not w.taints
        ]
        return out, next(self._rr)

    def in_flight(self, urls: Iterable[str]) -> int:
        return sum(self.workers[u].in_flight for u in urls)

    def status(self) -> dict[str, Any]:
        """The body of ``GET /fleet/status`` (without ``status``)."""
        newest = self.newest
        return {
            "epoch": newest.epoch if newest is not None else None,
            "version": newest.version if newest is not None else None,
            "baseline": self.baseline.to_json(),
            "workers": [
                {
                    "url": w.url,
                    "routable": w.machine.routable and not w.taints,
                    "fenced": w.machine.fenced,
                    "state": w.state,
                    "why": w.why,
                    "version": w.label.version if w.label else None,
                    "version_declared": w.label.declared if w.label else None,
                    "epoch": w.label.epoch if w.label else None,
                    "digest": w.label.digest if w.label else None,
                    "in_flight": w.in_flight,
                    "last_error": w.last_error,
                    "taints": list(w.taints),
                }
                for w in self.workers.values()
            ],
        }
