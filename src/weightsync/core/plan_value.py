"""A transfer plan as a value: every transfer of one update in execution order, the group
ranks it runs on, each worker's part, and the figures that say how well it balances.
:func:`~.planning.make_plan` builds it.  Pure Python."""

from __future__ import annotations

from typing import Any

import attrs

from weightsync.core.dtypes import itemsize
from weightsync.core.plan_part import PlanPart, Transfer
from weightsync.core.trainer_layout import TrainerLayout
from weightsync.core.worker_layout import FleetLayout


@attrs.frozen
class Plan:
    """Every transfer of one update, in execution order (see :mod:`.planning`)."""

    trainer: TrainerLayout
    fleet: FleetLayout
    bucket_bytes: int
    rounds: int
    transfers: tuple[Transfer, ...]

    @property
    def sources(self) -> int:
        return self.trainer.ranks

    @property
    def world_size(self) -> int:
        return self.trainer.ranks + sum(w.world_size for w in self.fleet.workers)

    def group_rank(self, worker: int, rank: int) -> int:
        return self.trainer.ranks + sum(w.world_size for w in self.fleet.workers[:worker]) + rank

    def rank_offset(self, worker: int) -> int:
        return self.group_rank(worker, 0)

    def for_source(self, src: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.src == src)

    def for_worker(self, worker: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.worker == worker)

    def needed_bytes(self, worker: int, rank: int) -> int:
        """Bytes of the plan's tensors that this destination serves."""
        served = self.fleet.workers[worker].served(rank)
        return sum(served[t.spec.name].numel * itemsize(t.spec.dtype) for t in self.trainer.tensors)

    def part(self, worker: int) -> PlanPart:
        """What ``worker`` needs to check and run its side of the plan."""
        w = self.fleet.workers[worker]
        specs = self.trainer.specs
        return PlanPart(
            worker=w.worker,
            index=worker,
            sources=self.sources,
            rank_offset=self.rank_offset(worker),
            world_size=self.world_size,
            bucket_bytes=self.bucket_bytes,
            tensors=specs,
            transfers=self.for_worker(worker),
        )

    def summary(self) -> dict[str, Any]:
        """The ``weightsync plan --json`` object.  ``bytes`` count what travels (a packed
        message's alignment padding included); ``needed_bytes`` what the destination serves."""
        sent = [0] * self.sources
        got: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            n = t.size  # what travels, 64-byte alignment padding included
            sent[t.src] += n
            got[(t.worker, t.rank)] = got.get((t.worker, t.rank), 0) + n
        receivers = [
            {"worker": w, "rank": r, "bytes": got.get((w, r), 0), "needed_bytes": self.needed_bytes(w, r)}
            for w, wl in enumerate(self.fleet.workers)
            for r in range(wl.world_size)
        ]
        return {
            "total_bytes": sum(sent),
            "rounds": self.rounds,
            "transfers": len(self.transfers),
            "senders": [{"rank": s, "bytes": b} for s, b in enumerate(sent)],
            "receivers": receivers,
        }


def fair_share(plan: Plan) -> float:
    """Total bytes over sources: what each link would carry in a perfect balance."""
    return sum(t.size for t in plan.transfers) / max(plan.sources, 1) if plan.transfers else 0.0


def max_sender_share(plan: Plan) -> float:
    """The busiest source's bytes over all bytes sent."""
    s = plan.summary()
    total = s["total_bytes"]
    return max(x["bytes"] for x in s["senders"]) / total if total else 0.0


def receiver_excess(plan: Plan) -> float:
    """Bytes received over bytes needed, summed over every destination rank."""
    s = plan.summary()
    need = sum(r["needed_bytes"] for r in s["receivers"])
    return sum(r["bytes"] for r in s["receivers"]) / need if need else 1.0
