"""A dedicated torch.distributed group for weight updates, on its own TCPStore.

``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) is constructed directly, so the
group never touches torch.distributed's default group or an engine's own groups.  Rank 0
(the trainer) hosts the store.  Every blocking step has a timeout, and joining the group
as a whole gives up within ``timeout_s`` (one deadline for connecting to the store and for
the rendezvous, not one timeout each).

The group's keys in the store are laid out exactly as torch lays out the groups the peers'
trainers form (:func:`group_store`), so a worker meets a trainer that never heard of
weightsync:

* ``process_group`` (the default, and weightsync's own trainer): SGLang's and OpenRLHF's
  ``init_custom_process_group`` (``sglang/srt/utils``, ``openrlhf/utils/distributed_util.py``),
  a copy of torch's ``init_process_group`` that wraps the store in ``PrefixStore(group_name)``
  before ``_new_process_group_helper``, which adds ``"<group_name>/"`` and the device's
  ``"cpu/"`` (gloo) or ``"cuda/"`` (nccl);
* ``default_group``: a trainer that called ``torch.distributed.init_process_group`` itself
  (``PrefixStore("default_pg")``, the default group's name ``"0"``, then the device).

A worker joins the trainer's store as torch's ``tcp://`` rendezvous does: as a client that
counts itself among ``world_size`` (the trainer's store waits for that count before its
rendezvous returns).  vLLM's ``StatelessProcessGroup`` rendezvous is :mod:`.stateless`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch
import torch.distributed as dist

from weightsync.core.errors import EngineFailure, EngineUnavailable, InvalidRequest
from weightsync.core.requests import MAX_TIMEOUT_S  # the one bound: a worker's join and a trainer's group


def check_timeout(timeout_s: float) -> float:
    """``timeout_s`` as a float.  Raises ``InvalidRequest`` (``invalid_value``) unless it is a
    finite number of seconds in ``(0, MAX_TIMEOUT_S]``: torch turns timeouts into clock
    deadlines, which overflow long before ``float`` does (``timeout_s: 1e300`` must be a
    refusal, not a crash)."""
    if (
        type(timeout_s) not in (int, float)
        or not math.isfinite(timeout_s)
        or not 0 < timeout_s <= MAX_TIMEOUT_S
    ):
        raise InvalidRequest(
            f"timeout_s must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, got {timeout_s!r}",
            code="invalid_value",
            field="timeout_s",
        )
    return float(timeout_s)


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Return once something accepts connections at ``host:port``; raise ``TimeoutError`` at
    ``deadline``.  (TCPStore's own connect retries can overrun its timeout by a whole attempt.)"""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nothing accepted a connection at {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=min(left, 1.0)):
                return
        except OSError:
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))


def local_address_towards(host: str) -> str:
    """The local address this machine uses to reach ``host``, IPv4 or IPv6 (no packet is
    sent).  Raises ``OSError`` when ``host`` does not resolve or is unreachable."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
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

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Start a point-to-point send of ``tensor`` to group rank ``dst``; returns the work."""
        return self.pg.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving exactly ``tensor``'s size from group rank ``src``; returns the work."""
        return self.pg.recv([tensor], src, tag)

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


LAYOUTS = ("process_group", "default_group")
"""The key layouts :func:`group_store` knows (see the module docstring)."""


def group_store(store: Any, name: str, backend: str, layout: str = "process_group") -> Any:
    """``store`` wrapped in the prefixes torch gives a ``backend`` group named ``name`` formed
    as ``layout`` says (``_new_process_group_helper``: the caller's prefix, ``"<group>/"``,
    then the device of the backend, ``"cpu/"`` for gloo, ``"cuda/"`` for nccl)."""
    outer, group = ("default_pg", "0") if layout == "default_group" else (name, name)
    device = "cuda" if backend == "nccl" else "cpu"
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group}/", dist.PrefixStore(outer, store)))


def connect_store(master_address: str, master_port: int, world_size: int, deadline: float) -> Any:
    """A client of the trainer's TCPStore, counted among ``world_size`` as torch's ``tcp://``
    rendezvous counts its members (a store hosted with a world size waits for that count).
    Raises ``TimeoutError``/``RuntimeError`` when nothing answers by ``deadline``."""
    _wait_for_listener(master_address, master_port, deadline)
    left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    return dist.TCPStore(master_address, master_port, world_size, False, left, wait_for_workers=True)


def connect_plain_store(master_address: str, master_port: int, timeout_s: float) -> Any:
    """A client of the trainer's TCPStore that is not counted among the group's members (the
    worker's own handle on a store whose group a helper process joined).  Raises
    ``TimeoutError``/``RuntimeError`` when nothing answers within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    _wait_for_listener(master_address, master_port, deadline)
    left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    store = dist.TCPStore(master_address, master_port, None, False, left, wait_for_workers=False)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


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
    layout: str = "process_group",
) -> Group:
    """Join (or, as rank 0 with ``store``, host) the group.  Blocks until every rank joined.
    ``layout`` names the trainer's way of forming it (:data:`LAYOUTS`).

    Raises ``InvalidRequest`` for a ``timeout_s`` out of range, and ``EngineUnavailable``
    (``rendezvous_failed``) when the rendezvous does not complete within ``timeout_s``
    (plus the few milliseconds it takes to notice); nothing is left behind.
    """
    timeout_s = check_timeout(timeout_s)
    deadline = time.monotonic() + timeout_s

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))

    try:
        if store is None:
            store = connect_store(master_address, master_port, world_size, deadline)
        store.set_timeout(left())  # the rendezvous waits in the store: what is left, not all again
        prefixed = group_store(store, name, backend, layout)
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = left()
            pg: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            device = torch.device("cpu")
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = left()
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
    finally:
        if store is not None:
            with contextlib.suppress(Exception):
                store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return Group(name, rank, world_size, backend, timeout_s, store, pg, device)


HASHER_NICE = 10
"""How much lower than the stream's own threads a stream's hashing thread runs (Linux nice
steps).  The wire is the critical path and the bytes must be hashed only by the end of the
stream: on a machine with few cores, a hashing thread at equal priority takes turns with the
collective's send and receive threads and slows the wire; one step down it fills the time
they leave.  With the kernel's autogroups the step counts only against this session's own
threads."""


def _lower_priority() -> None:
    if sys.platform.startswith("linux"):  # a thread id is a scheduling entity only there
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + HASHER_NICE))


def stream_hasher() -> ThreadPoolExecutor:
    """The one helper thread that hashes a stream's tensors while later ones are on the wire,
    at ``HASHER_NICE`` below the thread that made it (on Linux; elsewhere at its priority)."""
    return ThreadPoolExecutor(1, thread_name_prefix="weightsync-hash", initializer=_lower_priority)


class Window:
    """At most ``depth`` collectives in flight; each finished one runs its follow-up, in the
    order they were posted.  :meth:`post` returns a ticket; :meth:`finish` waits until that
    collective (and every earlier one) is done and followed up, so that the buffer it used
    may be refilled while later collectives stay in flight."""

    def __init__(self, group: Group, depth: int = 2, buffers: Sequence[torch.Tensor] = ()) -> None:
        self.group = group
        self.depth = depth
        self.pending: deque[tuple[Any, Callable[[], None] | None]] = deque()
        self.posted = 0  # tickets handed out
        self.done = 0  # tickets finished (and followed up)
        self.buffers = list(buffers)  # the ring :meth:`refill` hands out, in turn
        self._last_use = [-1] * len(self.buffers)  # the ticket of each buffer's last collective
        self._turns = 0
        self._filling: int | None = None
        self.broken = False
        """Whether a collective failed to start or to finish (the group is then out of step)."""

    def make_room(self) -> None:
        while len(self.pending) >= self.depth:
            self._finish_oldest()

    def refill(self) -> torch.Tensor:
        """The next buffer of the ring, once the collective that last used it (and every
        earlier one) is done and followed up; the next :meth:`post` is its use."""
        which = self._turns % len(self.buffers)
        self._turns += 1
        self.finish(self._last_use[which])
        self._filling = which
        return self.buffers[which]

    def post(self, tensor: torch.Tensor, then: Callable[[], None] | None = None) -> int:
        self.make_room()
        try:
            work = self.group.broadcast(tensor)
        except BaseException:
            self.broken = True
            raise
        self.pending.append((work, then))
        self.posted += 1
        if self._filling is not None:
            self._last_use[self._filling], self._filling = self.posted - 1, None
        return self.posted - 1

    def finish(self, ticket: int) -> None:
        while self.done <= ticket and self.pending:
            self._finish_oldest()

    def drain(self) -> None:
        while self.pending:
            self._finish_oldest()

    def settle(self) -> None:
        """Wait for the collectives still in flight without their follow-ups (the stream
        failed: their bytes are not wanted).  Never raises; a collective that fails here
        leaves the window :attr:`broken`."""
        while self.pending and not self.broken:
            work, _ = self.pending.popleft()
            self.done += 1
            try:
                self.group.wait(work)
            except Exception:
                self.broken = True

    def _finish_oldest(self) -> None:
        work, then = self.pending.popleft()
        self.done += 1
        try:
            self.group.wait(work)
        except BaseException:
            self.broken = True
            raise
        if then is not None:
            then()
