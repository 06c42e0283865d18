"""Joining the group vLLM's stock trainer forms: ``StatelessProcessGroup`` + ``PyNcclCommunicator``.

vLLM's ``nccl_common.trainer_init`` (the trainer of ``NCCLTrainerWeightTransferEngine``, and of
TRL's ``VLLMClient``) calls ``StatelessProcessGroup.create(host, port, rank=0, world_size)``,
whose rank 0 hosts a ``TCPStore`` that waits for ``world_size`` members, then
``PyNcclCommunicator(pg, device)``: rank 0 mints an ``ncclUniqueId`` and ``broadcast_obj``\\ s it
(pickled) under ``broadcast_from/0/0``; every rank calls ``ncclCommInitRank`` and a one-element
``all_reduce`` warm-up.  A worker follows it step for step (``worker_init_process_group``):
it joins the store as a counted member, reads the unique id through
:func:`~weightsync.transports.distributed.unique_id.read_nccl_unique_id` (never unpickled),
and builds its communicator with vLLM's own ``PyNcclCommunicator.from_unique_id_bytes``
(the init and the warm-up in one).

Where NCCL cannot run (no CUDA, or no vLLM to drive it), the worker stops right after reading
the id and refuses with ``NotSupported`` (``nccl_unavailable``, 501): the store and the id
exchange were joined, NCCL is the one missing piece.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from typing import Any

import attrs
import torch

from weightsync.core.errors import EngineFailure, EngineUnavailable, NotSupported
from weightsync.core.requests import InitGroupRequest
from weightsync.transports.distributed.group import connect_store
from weightsync.transports.distributed.unique_id import UNIQUE_ID_KEY, read_nccl_unique_id


@attrs.define(eq=False)
class CommGroup:
    """A worker's member of a vLLM trainer's NCCL communicator, offering what a foreign stream
    needs (``broadcast``/``wait``/``device``/``close``).  Broadcasts are enqueued on the
    current stream; :meth:`wait` synchronizes it."""

    name: str
    rank: int
    world_size: int
    timeout_s: float
    comm: Any
    device: torch.device
    backend: str = "nccl"

    def broadcast(self, tensor: torch.Tensor) -> Any:
        stream = torch.cuda.current_stream(self.device)
        self.comm.broadcast(tensor, src=0, stream=stream)
        return stream

    def wait(self, work: Any) -> None:
        work.synchronize()

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            with contextlib.suppress(Exception):
                comm.destroy()


def nccl_missing() -> str | None:
    """Why this process cannot join a NCCL communicator, or None when it can."""
    if not torch.cuda.is_available():
        return "this worker has no CUDA device (NCCL runs on GPUs only)"
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # noqa: F401
    except Exception as exc:
        return f"vLLM's PyNcclCommunicator cannot be imported here ({type(exc).__name__})"
    return None


def join_stateless(req: InitGroupRequest, rank: int) -> CommGroup:
    """Join ``req``'s group as ``rank`` the way vLLM's workers do (module docstring).  Raises
    ``EngineUnavailable`` (``rendezvous_failed``) when the store or the unique id does not come
    within ``req.timeout_s``, ``InvalidRequest`` (``bad_unique_id``) for a store value that is
    not the id, ``NotSupported`` (``nccl_unavailable``) where NCCL cannot run."""
    deadline = time.monotonic() + req.timeout_s
    where = f"{req.master_address}:{req.master_port}"
    try:
        store = connect_store(req.master_address, req.master_port, req.world_size, deadline)
        left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        store.set_timeout(left)
        store.wait([UNIQUE_ID_KEY], left)
        raw = store.get(UNIQUE_ID_KEY)
    except Exception as exc:
        raise EngineUnavailable(
            f"could not join vLLM's StatelessProcessGroup at {where} as rank {rank}/{req.world_size} "
            f"within {req.timeout_s}s (no store, or rank 0 never published its NCCL unique id): {exc}",
            code="rendezvous_failed",
        ) from None
    unique_id = read_nccl_unique_id(raw)
    missing = nccl_missing()
    if missing is not None:
        raise NotSupported(
            f"joined vLLM's StatelessProcessGroup at {where} as rank {rank} and read the trainer's "
            f"NCCL unique id; NCCL is the one missing piece: {missing}.  On CPU, name backend "
            "'gloo' in init_info and form a gloo group (torch.distributed.init_process_group)",
            code="nccl_unavailable",
        )
    return _communicator(req, rank, unique_id)


def _communicator(req: InitGroupRequest, rank: int, unique_id: bytes) -> CommGroup:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        comm = PyNcclCommunicator.from_unique_id_bytes(
            unique_id, rank=rank, world_size=req.world_size, device=device
        )
    except Exception as exc:
        raise EngineFailure(
            f"ncclCommInitRank with the trainer's unique id failed: {exc}", code="rendezvous_failed"
        ) from None
    return CommGroup(req.group_name, rank, req.world_size, req.timeout_s, comm, device)
