"""Tensor parallelism for the reference engine: rank 0 drives ranks 1..T-1.

:meth:`TPRunner.start` spawns the other ranks and joins their gloo group
(:class:`~.tp_processes.RankProcesses`), and keeps rank 0's part of the model in this
process.  Every runner call is one *command*: sent to every rank, run by rank 0 at the same
time (the collectives of a forward, or the slices of a tensor, meet in the group), then every
rank's answer collected, in one order for all ranks.

Weights are described, loaded and hashed as the full logical tensors: a load streams full
tensors into a :class:`ShardSink`, which sends every rank its slice; the digest (``hashes``)
is the xxh3-64 of each full tensor, gathered slice by slice, exactly what the one-process
engine reports for the same weights.  A replicated tensor is hashed on every rank; when a
rank's copy differs from rank 0's, that rank's hash is reported, so an attestation never
passes over a diverged replica.

Failure: a rank that dies, answers an error, or does not answer within ``timeout_s`` (the
group's own timeout bounds a collective too) fails the runner for good: the remaining ranks
are stopped and every call raises :class:`~weightsync.core.errors.EngineFailure`
(``tp_rank_failed``, a 500) at once; ``alive()`` turns false.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from weightsync.core.errors import EngineUnavailable, IllegalState, InvalidRequest
from weightsync.core.plan.layouts import WorkerLayout
from weightsync.core.requests import InitGroupRequest
from weightsync.core.snapshot import TensorSpec, WeightInfo
from weightsync.core.sources import PlanSource
from weightsync.engines.reference.model import ModelConfig
from weightsync.engines.reference.rank import RankModel
from weightsync.engines.reference.shard_sink import ShardSink
from weightsync.engines.reference.tp_layout import FULL, Part, check_tp_size, take, tp_layout
from weightsync.engines.reference.tp_layout import worker_layout as tp_worker_layout
from weightsync.engines.reference.tp_plan import Outcome, rank_receive, receive_budget_s
from weightsync.engines.reference.tp_processes import RankProcesses, attempt
from weightsync.engines.reference.tp_rank import all_reduce, local_boxes
from weightsync.transports.distributed.receiver import START_GRACE_S
from weightsync.transports.distributed.worker import GroupRegistry
from weightsync.transports.hashing import tensor_hash

T = TypeVar("T")


class TPRunner:
    """A :class:`~.runner.Runner` over ``size`` tensor-parallel ranks (see the module docstring)."""

    initial_hashes: dict[str, str]  # of the seeded weights it started with, as full tensors

    def __init__(self, config: ModelConfig, size: int, *, slots: int, timeout_s: float) -> None:
        check_tp_size(config, size)
        self.config, self.size, self.slots, self.timeout_s = config, size, slots, timeout_s
        self.layout: list[dict[str, Part]] = tp_layout(config, size)
        self.ranks = RankProcesses(size, timeout_s)  # ranks 1..size-1
        self._update_groups: set[str] = set()  # weight-update groups every rank joined
        self.local: RankModel | None = None

    @classmethod
    def start(cls, config: ModelConfig, size: int, *, slots: int = 8, timeout_s: float = 60.0) -> TPRunner:
        """Spawn ranks 1..size-1 and wait until every rank holds its part of the seeded model.
        Raises ``InvalidRequest`` for a size that does not split ``config`` and
        ``EngineFailure`` when a rank does not come up within ``timeout_s``."""
        self = cls(config, size, slots=slots, timeout_s=timeout_s)
        try:
            self.ranks.spawn(config, slots)
            self.local = RankModel(
                config, slots=slots, rank=0, size=size, reduce=all_reduce(self.ranks.group), hash_initial=True
            )
        except BaseException:
            self.close()
            raise
        assert self.local.initial_hashes is not None
        self.initial_hashes = self.local.initial_hashes
        return self

    def call(
        self,
        op: str,
        *args: Any,
        local: Callable[[RankModel], T] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[T | None, list[Any]]:
        """Run command ``op`` on ranks 1.. and ``local`` on rank 0 at the same time; returns
        rank 0's result and the others' answers (by rank), each within ``timeout_s`` (the
        runner's own by default).  Raises ``EngineFailure``."""

        def mine() -> T | None:
            assert self.local is not None
            return local(self.local) if local is not None else None

        return self.ranks.command(op, args, mine, timeout_s)

    def check(self) -> None:
        self.ranks.check()

    # ------------------------------------------------------------------ Runner

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        logits, _ = self.call(
            "forward",
            tokens.tolist(),
            slots.tolist(),
            start.tolist(),
            local=lambda m: m.forward(tokens, slots, start),
        )
        assert logits is not None
        return logits

    def save_block(self, block: int, slot: int, n: int) -> None:
        self.call("save_block", block, slot, n, local=lambda m: m.save_block(block, slot, n))

    def load_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        self.call("load_blocks", slot, list(blocks), local=lambda m: m.load_blocks(slot, blocks))

    def free_blocks(self, blocks: Sequence[int]) -> None:
        if self.ranks.failure is None:  # a failed engine has nothing left to free
            self.call("free_blocks", list(blocks), local=lambda m: m.free_blocks(blocks))

    def weight_info(self) -> WeightInfo:
        dtype = self.config.dtype
        return WeightInfo([TensorSpec(n, dtype, s) for n, s in self._full_shapes().items()])

    def _full_shapes(self) -> dict[str, tuple[int, ...]]:
        assert self.local is not None
        return self.local.full_shapes

    def sink(self, staged: bool) -> ShardSink:
        if staged:
            self.call("stage", local=lambda m: m.stage())
        return ShardSink(self.scatter, self._full_shapes(), self.config.dtype, staged)

    def swap_staged(self) -> None:
        self.call("swap", local=lambda m: m.swap())

    def drop_staged(self) -> None:
        if self.ranks.failure is None:
            self.call("drop", local=lambda m: m.drop())

    def scatter(self, name: str, full: torch.Tensor, staged: bool) -> None:
        """Load the full tensor ``name``: every rank gets its slice over the group."""

        def send(m: RankModel) -> None:
            for rank in range(1, self.size):
                piece = take(full, self.layout[rank][name]).contiguous()
                self.ranks.group.send([piece], rank, 0).wait()
            m.load_full(name, full, staged=staged)

        self.call("recv_slice", name, staged, local=send)

    def hashes(self, staged: bool = False, names: Sequence[str] | None = None) -> dict[str, str]:
        """The digest of every weight (or of ``names``), as full logical tensors gathered from
        the ranks; ``staged``: of the staging copy."""
        names = list(self._full_shapes()) if names is None else list(names)
        sharded = [n for n in names if self.layout[0][n] != FULL]

        def gather(m: RankModel) -> dict[str, str]:
            weights, out = m.targets(staged), {}
            for name in names:
                part = self.layout[0][name]
                if part == FULL:
                    out[name] = tensor_hash(weights[name])
                    continue
                pieces = [weights[name]]
                for rank in range(1, self.size):
                    buf = torch.empty(self._shape_on(rank, name), dtype=weights[name].dtype)
                    self.ranks.group.recv([buf], rank, 0).wait()
                    pieces.append(buf)
                out[name] = tensor_hash(torch.cat(pieces, dim=part[0]))
            return out

        mine, theirs = self.call("digest", sharded, staged, names, local=gather)
        assert mine is not None
        for replicas in theirs:
            for name, h in replicas.items():
                if h != mine[name]:
                    mine[name] = h  # a diverged replica: never attest over it
        return mine

    def _shape_on(self, rank: int, name: str) -> tuple[int, ...]:
        shape = list(self._full_shapes()[name])
        part = self.layout[rank][name]
        if part != FULL:
            shape[part[0]] = part[2]
        return tuple(shape)

    def shard_info(self) -> list[dict[str, tuple[str, tuple[int, ...]]]]:
        """Per rank, the dtype and shape of what it holds of every weight (inspection)."""

        def own(m: RankModel) -> dict[str, tuple[str, tuple[int, ...]]]:
            return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in m.weights().items()}

        mine, theirs = self.call("shard_info", local=own)
        assert mine is not None
        return [mine, *theirs]

    # ------------------------------------------------------------------ sharded plans

    def worker_layout(self, worker: str) -> WorkerLayout:
        """What every rank serves, as a transfer plan's layout for the worker named ``worker``."""
        return tp_worker_layout(self.config, self.size, worker)

    def joined_by_all(self, name: str) -> bool:
        """Whether every rank is a member of the weight-update group ``name``."""
        return name in self._update_groups

    def join_update_group(self, registry: GroupRegistry, req: InitGroupRequest) -> None:
        """Join ``req``'s group on every rank at once: rank ``r`` at ``rank_offset + r``, rank 0
        into ``registry``.  All or nothing: when a rank fails, the others leave again.  Raises
        ``InvalidRequest`` when the group has no room for every rank, ``IllegalState``
        (``group_exists``), ``EngineUnavailable`` (``rendezvous_failed``)."""
        if req.rank_offset + self.size > req.world_size:
            raise InvalidRequest(
                f"this worker has {self.size} tensor-parallel ranks: rank_offset {req.rank_offset} + "
                f"{self.size} exceeds world_size {req.world_size}",
                code="invalid_value",
                field="world_size",
            )
        if req.group_name in registry.names():
            raise IllegalState(
                f"group {req.group_name!r} already exists; destroy it first", code="group_exists"
            )
        mine, theirs = self.call(
            "join_update_group",
            req,
            local=lambda m: attempt(registry.join, req),
            # a helper process may take START_GRACE_S to start beyond the rendezvous itself
            timeout_s=req.timeout_s + (START_GRACE_S if req.receiver == "process" else 0.0) + self.timeout_s,
        )
        failed = [(r, a["error"]) for r, a in enumerate(theirs, start=1) if a is not None]
        if mine is None and not failed:
            self._update_groups.add(req.group_name)
            return
        self.leave_update_group(registry, req.group_name)
        if isinstance(mine, BaseException):
            raise mine
        rank, error = failed[0]
        raise EngineUnavailable(
            f"tensor-parallel rank {rank} could not join weight-update group {req.group_name!r}: {error}",
            code="rendezvous_failed",
        )

    def leave_update_group(self, registry: GroupRegistry, name: str) -> None:
        """Every rank leaves the group ``name`` (those that are not in it: nothing to do)."""
        self._update_groups.discard(name)
        if self.ranks.failure is None:
            self.call("leave_update_group", name, local=lambda m: attempt(registry.destroy, name))
        else:
            attempt(registry.destroy, name)

    def receive_plan(self, registry: GroupRegistry, source: PlanSource, staged: bool) -> list[Outcome]:
        """Every rank receives its transfers of ``source``'s part at the same time
        (:func:`.tp_plan.rank_receive`); returns the outcomes, by rank."""
        part = source.part
        specs = {s.name: s for s in part.tensors}
        timeout = registry.plan_group(source.group_name).timeout_s

        def mine(m: RankModel) -> Outcome:
            locals_ = local_boxes(m, staged, list(specs))
            return rank_receive(
                registry, source.group_name, source.stream_id, part.for_rank(0), specs, locals_
            )

        out, theirs = self.call(
            "recv_plan",
            source.group_name,
            source.stream_id,
            part,
            staged,
            local=mine,
            timeout_s=receive_budget_s(part, self.size, timeout) + self.timeout_s,
        )
        assert out is not None
        return [out, *theirs]

    def alive(self) -> bool:
        return self.ranks.alive()

    def close(self) -> None:
        """Stop every rank (bounded: a rank that does not stop is killed) and leave the group."""
        self.ranks.close()
