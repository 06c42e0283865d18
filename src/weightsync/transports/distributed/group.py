"""A dedicated torch.distributed group for weight updates, on its own TCPStore.

``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) is constructed directly, so the
group never touches torch.distributed's default group or an engine's own groups.  Rank 0
(the trainer) hosts the store.  Every blocking step has a timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist

from weightsync.core.errors import EngineFailure, EngineUnavailable


def local_address_towards(host: str) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


@attrs.define(eq=False)
class Group:
    """One member's view of a weight-update group."""

    name: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    store: Any
    pg: Any
    device: torch.device

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from rank 0 into/out of ``tensor``; returns the work handle."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self.pg.broadcast([tensor], opts)

    def wait(self, work: Any) -> None:
        if not work.wait(datetime.timedelta(seconds=self.timeout_s)):
            raise EngineFailure(
                f"group {self.name!r}: collective timed out after {self.timeout_s}s", code="timeout"
            )

    _buffers: list[torch.Tensor] = attrs.field(factory=list)

    def buffers(self, size: int) -> list[torch.Tensor]:
        """Two byte buffers of at least ``size`` bytes, kept across streams (allocating and
        faulting in fresh pages for every push costs more than the copies)."""
        if not self._buffers or self._buffers[0].numel() < size:
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._buffers

    def close(self) -> None:
        self._buffers = []
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.shutdown()
        self.store = None


def create_group(
    name: str,
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    store: Any = None,
) -> Group:
    """Join (or, as rank 0 with ``store``, host) the group.  Blocks until every rank joined.

    Raises ``EngineUnavailable`` (``rendezvous_failed``) when the rendezvous does not complete
    within ``timeout_s``; nothing is left behind.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(master_address, master_port, None, False, timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(f"weightsync/{name}", store)
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            device = torch.device("cpu")
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [
                dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))
            ]
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    except Exception as exc:
        raise EngineUnavailable(
            f"could not join weight-update group {name!r} at {master_address}:{master_port} as rank "
            f"{rank}/{world_size} within {timeout_s}s: {exc}",
            code="rendezvous_failed",
        ) from None
    return Group(name, rank, world_size, backend, timeout_s, store, pg, device)


class Window:
    """At most ``depth`` collectives in flight; each finished one runs its follow-up."""

    def __init__(self, group: Group, depth: int = 2) -> None:
        self.group = group
        self.depth = depth
        self.pending: deque[tuple[Any, Callable[[], None] | None]] = deque()

    def make_room(self) -> None:
        while len(self.pending) >= self.depth:
            self._finish_oldest()

    def post(self, tensor: torch.Tensor, then: Callable[[], None] | None = None) -> None:
        self.make_room()
        self.pending.append((self.group.broadcast(tensor), then))

    def drain(self) -> None:
        while self.pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, then = self.pending.popleft()
        self.group.wait(work)
        if then is not None:
            then()
