"""A sharded transfer plan into a tensor-parallel reference engine: every rank receives its
own pieces on the weight-update group, and the update commits on all ranks or on none.

Each rank is a member of the weight-update group at the rank the plan gives it (rank ``r``
of a worker at ``rank_offset + r``): ``init_weights_update_group`` joins rank 0 here and
ranks 1..T-1 in their own processes (:meth:`.tp_runner.TPRunner.join_update_group`), and
the join succeeds only when every rank joined.  An update from a plan then runs in four steps:

1. rank 0 checks the worker's whole part of the plan against the engine's own layout
   (:func:`~weightsync.core.plan.check.check_part` with every rank's served boxes) and every
   source's manifest against the transfers of *every* rank, before any rank marks itself
   ready — so a refusal is one answer for the whole worker, and no rank is left waiting for a go;
2. every rank, at the same time, marks itself ready, waits for the trainer's go, receives
   its transfers straight into the boxes it serves (the served weights, or the staging copy
   of an unpaused update) and verifies each piece against its source's xxh3-64
   (:func:`~weightsync.transports.plan.receive.receive`);
3. each rank answers with an outcome (:func:`rank_receive`: never an exception, so a bad
   source cannot fail the engine); rank 0 joins them: the update succeeds only if every rank
   succeeded.  Otherwise it fails with ``wrote`` true when any rank had begun writing — in
   place that is torn for the whole worker (the ranks' weights are one set of weights), staged
   it is the staging copy dropped on every rank — and a rank whose stream broke takes the
   group down on every rank (a new one must be set up);
4. the digest is that of what the worker serves, as for any other load: the full logical
   tensors, gathered from the ranks' shards and hashed whole (one pass over the group of
   ranks), so a TP worker and a one-process worker holding the same weights report the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from weightsync.core.dtypes import itemsize
from weightsync.core.errors import InvalidRequest, LoadFailed, NotSupported, WeightSyncError
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.check import check_part
from weightsync.core.plan.value import PlanPart, Transfer
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import PlanSource
from weightsync.engines.reference.shard_sink import ShardSink
from weightsync.transports.distributed.worker import GroupRegistry
from weightsync.transports.failures import describe_exception
from weightsync.transports.plan.receive import (
    PlanGroup,
    expect_manifests,
    handshake,
    in_step,
    placed_group,
    receive,
    settle,
)

Outcome = dict[str, Any]
"""A rank's answer: ``{"ok": True, "bytes": n}`` or ``{"ok": False, "error": <to_wire>,
"broken": bool}`` (``broken``: its stream broke and it dropped the group)."""


def receive_budget_s(part: PlanPart, ranks: int, group_timeout_s: float) -> float:
    """How long the slowest of ``ranks`` ranks may legitimately take to receive its transfers
    of ``part``: each blocking step of :func:`rank_receive` (the go, each message, each of
    its sources' hashes) waits at most one group timeout, plus two for slack.  A deadline
    shorter than this would let a long (valid) plan look like a hung rank."""
    steps = 0
    for r in range(ranks):
        mine = part.for_rank(r)
        steps = max(steps, 1 + len(mine) + len({t.src for t in mine}))
    return (steps + 2) * group_timeout_s


def rank_receive(
    registry: GroupRegistry,
    group_name: str,
    stream_id: str,
    transfers: tuple[Transfer, ...],
    specs: Mapping[str, TensorSpec],
    locals_: Mapping[str, tuple[torch.Tensor, Box]],
) -> Outcome:
    """One rank's side of a plan (step 2 of the module docstring).  Never raises: every
    failure is an outcome.  A stream that broke drops ``group_name`` from ``registry``."""
    wrote = False

    def on_write() -> None:
        nonlocal wrote
        wrote = True

    group: PlanGroup | None = None
    started = False  # past the go: a failure from here on may leave the group out of step
    try:
        group = registry.plan_group(group_name)
        handshake(group, stream_id)
        started = True
        for _ in receive(group, stream_id, transfers, specs, locals_, on_write):
            pass
    except Exception as exc:
        failure: Exception = exc
        broken = False
        if group is not None and (started or not isinstance(exc, WeightSyncError)):
            failure = settle(registry, group, stream_id, exc)  # the group dropped unless in step
            broken = not in_step(failure)
        if not isinstance(failure, WeightSyncError):
            failure = LoadFailed(
                f"plan {stream_id!r} on group {group_name!r} broke: {describe_exception(exc)}",
                wrote=wrote,
                code="stream_failed",
            )
        cause = failure.cause if isinstance(failure, LoadFailed) else failure
        error = LoadFailed(failure.message, wrote=wrote, cause=None if wrote else cause, code=failure.code)
        return {"ok": False, "error": error.to_wire(), "broken": broken}
    return {"ok": True, "bytes": sum(t.size for t in transfers)}


def joined_outcome(outcomes: list[Outcome], stream_id: str) -> LoadFailed | None:
    """The worker's failure from its ranks' outcomes (``None`` when every rank succeeded):
    ``wrote`` when any rank wrote (a rank that succeeded wrote whatever it received); the
    code of a failed rank that wrote (its bytes are what tore), else of the first that
    failed."""
    errors = [(r, WeightSyncError.from_wire(o["error"])) for r, o in enumerate(outcomes) if not o["ok"]]
    if not errors:
        return None
    wrote = any(
        o.get("error", {}).get("wrote") is True if not o["ok"] else o.get("bytes", 0) > 0 for o in outcomes
    )
    rank, first = next(((r, e) for r, e in errors if getattr(e, "wrote", False)), errors[0])
    ranks = ", ".join(str(r) for r, _ in errors)
    cause = None if wrote else (first.cause if isinstance(first, LoadFailed) else first)
    return LoadFailed(
        f"plan {stream_id!r} failed on rank(s) {ranks} of this worker; rank {rank}: {first.message}",
        wrote=wrote,
        cause=cause,
        code=first.code,
    )


class TPPlanReader:
    """The plan channel of a tensor-parallel reference engine (see the module docstring).

    Raises (``validate``) ``InvalidRequest`` (``layout_mismatch``) or ``NotFound``
    (``unknown_group``) before anything moves; (``stream``) ``InvalidRequest``
    (``stream_mismatch``) or ``LoadFailed`` (``stream_aborted``) before any rank is ready,
    ``LoadFailed`` (``stream_failed``, ``checksum_mismatch``) after."""

    kind = "plan"

    def __init__(self, runner: Any, registry: GroupRegistry, source: PlanSource) -> None:
        self.runner, self.registry, self.source = runner, registry, source
        self._received: list[int] = []

    def validate(self, specs: Mapping[str, TensorSpec]) -> None:
        part = self.source.part
        group = placed_group(self.registry, self.source.group_name, part)
        if not self.runner.joined_by_all(group.name):
            raise InvalidRequest(
                f"group {group.name!r} was not joined by every tensor-parallel rank of this worker",
                code="layout_mismatch",
            )
        layout = self.runner.worker_layout("self")
        served = [layout.served(r) for r in range(layout.world_size)]
        check_part(part, served, list(specs.values()))

    def stream(self, target: Any) -> Iterator[None]:
        if not isinstance(target, ShardSink):
            raise NotSupported(
                "a plan reaches a tensor-parallel engine's own sink only", code="not_supported"
            )
        group = self.registry.plan_group(self.source.group_name)
        sid = self.source.stream_id
        expect_manifests(group, sid, self.source.part.transfers)  # every rank's, before any is ready
        yield
        outcomes = self.runner.receive_plan(self.registry, self.source, target.staged)
        failure = joined_outcome(outcomes, sid)
        if failure is not None:
            target.wrote = failure.wrote
            if any(o.get("broken") for o in outcomes):
                self.runner.leave_update_group(self.registry, group.name)
            raise failure
        target.wrote = True
        self._received = [int(o["bytes"]) for o in outcomes]
        yield
        names = [s.name for s in self.source.part.tensors]
        hashes = self.runner.hashes(staged=target.staged, names=names)
        for spec in self.source.part.tensors:  # the digest is that of what this worker now serves
            target.hashes[spec.name] = hashes[spec.name]
            target.written.append(spec.name)
            target.tensors += 1
            target.bytes += math.prod(spec.shape) * itemsize(spec.dtype)

    def extra(self) -> dict[str, Any]:
        """``verified`` (every piece checked against its source) and ``received_bytes``: per
        rank, the bytes it received (what it serves of the plan's tensors, plus alignment)."""
        return {"verified": True, "received_bytes": list(self._received)}

    def close(self) -> None:
        """Nothing is held between validation and the stream."""
