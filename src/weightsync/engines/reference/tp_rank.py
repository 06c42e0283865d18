"""A tensor-parallel rank of the reference engine, ranks 1..T-1: the command loop.

Rank 0 (the serving process, :mod:`.tp_runner`) spawns each rank with :func:`rank_main`.
The ranks form one gloo group (``ProcessGroupGloo`` built directly on rank 0's TCPStore,
so no default process group exists), used for the forward's all-reduces and to move
weight slices; commands arrive over a pipe, one at a time, in the order rank 0 issues them:
``(op, args)`` answered by ``("ok", result)`` or ``("error", message)``.  Every op is a
function in :data:`COMMANDS`; one that moves bytes over the group does so in an order rank 0
mirrors.  A rank exits on ``stop``, when the pipe closes (rank 0 died), or after an error in
a collective (the group is then out of step; rank 0 treats the engine as failed).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from weightsync.core.plan.value import PlanPart
from weightsync.core.requests import InitGroupRequest
from weightsync.engines.reference.model import ModelConfig, Reduce
from weightsync.engines.reference.rank import RankModel
from weightsync.engines.reference.tp_layout import FULL, part_box
from weightsync.engines.reference.tp_plan import Outcome, rank_receive
from weightsync.transports.distributed.worker import GroupRegistry
from weightsync.transports.failures import describe_exception
from weightsync.transports.hashing import tensor_hash

log = logging.getLogger("weightsync.reference.tp")

GROUP_PREFIX = "weightsync/reference-tp"


def join_group(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """The ranks' gloo group on ``store`` (blocks until all ``size`` ranks joined)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore(GROUP_PREFIX, store), rank, size, opts)


def all_reduce(group: Any) -> Reduce:
    """Sum a tensor over the group (in float32, so every rank gets the same bits)."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        y = x.float().contiguous()
        group.allreduce([y]).wait()
        return y.to(x.dtype)

    return reduce


# ---------------------------------------------------------------------- commands
# Each takes (model, group, *args) and returns something picklable.


def _forward(m: RankModel, g: Any, tokens: list[list[int]], slots: list[int], start: list[int]) -> None:
    m.forward(torch.tensor(tokens), torch.tensor(slots), torch.tensor(start))


def _recv_slice(m: RankModel, g: Any, name: str, staged: bool) -> None:
    """Receive this rank's slice of ``name`` from rank 0 and load it (:meth:`RankModel.load_slice`)."""
    own = m.targets(staged)[name]
    buf = torch.empty_like(own)
    g.recv([buf], 0, 0).wait()
    m.load_slice(name, buf, m.parts[name], staged=staged)


def _digest(
    m: RankModel, g: Any, sharded: list[str], staged: bool = False, names: list[str] | None = None
) -> dict[str, str]:
    """Send rank 0 this rank's slice of every ``sharded`` weight, in order; return the hash of
    every replicated one (rank 0 compares the replicas).  ``staged``: of the staging copy;
    ``names``: of these weights only."""
    weights = m.targets(staged)
    for name in sharded:
        g.send([weights[name].contiguous()], 0, 0).wait()
    wanted = set(weights) if names is None else set(names)
    return {n: tensor_hash(t) for n, t in weights.items() if m.parts[n] == FULL and n in wanted}


# The weight-update groups this rank joined (a plan's receiver at rank_offset + rank).
UPDATE_GROUPS = GroupRegistry()


def _join_update_group(m: RankModel, g: Any, req: InitGroupRequest) -> dict[str, Any] | None:
    """Join ``req``'s group as this rank; a failure is the answer (the engine survives it)."""
    try:
        UPDATE_GROUPS.join(req, local_rank=m.rank)
    except Exception as exc:
        return {"error": describe_exception(exc)}
    return None


def _leave_update_group(m: RankModel, g: Any, name: str) -> None:
    with contextlib.suppress(Exception):
        UPDATE_GROUPS.destroy(name)


def local_boxes(m: RankModel, staged: bool, names: list[str]) -> dict[str, tuple[torch.Tensor, Any]]:
    """Name -> (this rank's tensor of it, the box of the full tensor that tensor holds)."""
    targets = m.targets(staged)
    return {n: (targets[n], part_box(m.full_shapes[n], m.parts[n])) for n in names}


def _recv_plan(
    m: RankModel, g: Any, group_name: str, stream_id: str, part: PlanPart, staged: bool
) -> Outcome:
    """Receive this rank's transfers of ``part`` (:func:`.tp_plan.rank_receive`)."""
    specs = {s.name: s for s in part.tensors}
    locals_ = local_boxes(m, staged, list(specs))
    return rank_receive(UPDATE_GROUPS, group_name, stream_id, part.for_rank(m.rank), specs, locals_)


def _shard_info(m: RankModel, g: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in m.weights().items()}


COMMANDS: dict[str, Callable[..., Any]] = {
    "forward": _forward,
    "save_block": lambda m, g, block, slot, n: m.save_block(block, slot, n),
    "load_blocks": lambda m, g, slot, blocks: m.load_blocks(slot, blocks),
    "free_blocks": lambda m, g, blocks: m.free_blocks(blocks),
    "stage": lambda m, g: m.stage(),
    "swap": lambda m, g: m.swap(),
    "drop": lambda m, g: m.drop(),
    "recv_slice": _recv_slice,
    "digest": _digest,
    "join_update_group": _join_update_group,
    "leave_update_group": _leave_update_group,
    "recv_plan": _recv_plan,
    "shard_info": _shard_info,
}


def rank_main(
    rank: int, size: int, port: int, config: ModelConfig, slots: int, timeout_s: float, conn: Connection
) -> None:
    """Run rank ``rank`` of ``size`` until told to stop (see the module docstring)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    group = None
    try:
        store = dist.TCPStore("127.0.0.1", port, size, False, datetime.timedelta(seconds=timeout_s))
        group = join_group(store, rank, size, timeout_s)
        model = RankModel(config, slots=slots, rank=rank, size=size, reduce=all_reduce(group))
        conn.send(("ok", None))
        while True:
            try:
                op, args = conn.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if op == "stop":
                conn.send(("ok", None))
                return
            try:
                result = COMMANDS[op](model, group, *args)
            except Exception as exc:
                log.exception("tensor-parallel rank %d: %s failed", rank, op)
                conn.send(("error", f"{op}: {describe_exception(exc)}"))
                return  # the group may be out of step: rank 0 fails the engine
            conn.send(("ok", result))
    except (EOFError, OSError, BrokenPipeError):
        return
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"rank {rank} failed to start: {describe_exception(exc)}"))
    finally:
        with contextlib.suppress(Exception):
            UPDATE_GROUPS.close()
        if group is not None:
            with contextlib.suppress(Exception):
                group.shutdown()
        conn.close()
