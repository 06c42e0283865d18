"""Tensor transport over POSIX shared memory, for a trainer colocated with the worker.

The trainer copies its tensors once into a shared-memory segment (:func:`share_tensors`) and
posts ``update_weights_from_tensor`` with one handle per tensor,
``{"shm": "<segment>", "offset": <bytes>}``; the worker maps the segment and copies each
tensor straight from it into the engine.  Everything is checked before the first write:
the segment exists and carries weightsync's name prefix (a request cannot make the worker
read arbitrary shared memory), every tensor lies inside it, and names, shapes and dtypes
fit the engine.  CUDA IPC handles (``{"cuda_ipc": ...}``) are refused with 501 for now.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import attrs
import torch

from weightsync.core.errors import InvalidRequest, LoadFailed, NotFound, NotSupported, WeightSyncError
from weightsync.core.requests import TensorHandle, TensorSource
from weightsync.core.values import LoadStats

from ..distributed.layout import ALIGN, ITEMSIZE
from ..sink import TensorSink, check_metadata, dtype_name, torch_dtype

PREFIX = "weightsync_"


def _open(name: str) -> shared_memory.SharedMemory:
    if not name.startswith(PREFIX):
        raise InvalidRequest(
            f"shared-memory segment {name!r} is not a weightsync segment", code="invalid_value"
        )
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        raise NotFound(f"no shared-memory segment {name!r}", code="segment_not_found") from None
    # Only the creator may unlink it: stop this process's resource tracker from doing so.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _close(segments: dict[str, shared_memory.SharedMemory]) -> None:
    for shm in segments.values():
        # A view may still be referenced (by an error's traceback): then it is unmapped when freed.
        with contextlib.suppress(BufferError):
            shm.close()


def _view(segment: shared_memory.SharedMemory, p: _Placed) -> torch.Tensor:
    spec = p.handle.spec
    if p.nbytes == 0:
        return torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
    raw = torch.frombuffer(segment.buf, dtype=torch.uint8, count=p.nbytes, offset=p.offset)
    return raw.view(torch_dtype(spec.dtype)).reshape(spec.shape)


@attrs.frozen
class _Placed:
    handle: TensorHandle
    segment: str
    offset: int
    nbytes: int


def _place(handle: TensorHandle) -> _Placed:
    h = handle.handle
    if "cuda_ipc" in h:
        raise NotSupported("CUDA IPC handles are not supported by this worker yet", code="not_supported")
    if (
        set(h) != {"shm", "offset"}
        or type(h["shm"]) is not str
        or type(h["offset"]) is not int
        or h["offset"] < 0
    ):
        raise InvalidRequest(
            f"{handle.spec.name}: handle must be {{'shm': str, 'offset': int >= 0}}", code="invalid_value"
        )
    nbytes = math.prod(handle.spec.shape) * ITEMSIZE[handle.spec.dtype]
    return _Placed(handle, h["shm"], h["offset"], nbytes)


def load_shared(source: TensorSource, sink: TensorSink) -> LoadStats:
    """Validate every handle, then copy the tensors into ``sink``.  Raises ``LoadFailed``."""
    t0 = time.perf_counter()
    segments: dict[str, shared_memory.SharedMemory] = {}
    try:
        try:
            placed = [_place(h) for h in source.tensors]
            check_metadata((p.handle.spec for p in placed), sink.specs, allow_partial=True)
            for p in placed:
                if p.segment not in segments:
                    segments[p.segment] = _open(p.segment)
                if p.offset + p.nbytes > segments[p.segment].size:
                    raise InvalidRequest(
                        f"{p.handle.spec.name}: bytes {p.offset}..{p.offset + p.nbytes} lie outside segment "
                        f"{p.segment!r} ({segments[p.segment].size} bytes)",
                        code="invalid_value",
                    )
        except WeightSyncError as exc:
            raise LoadFailed(exc.message, wrote=False, cause=exc) from exc
        try:
            for p in placed:
                sink.write(p.handle.spec.name, _view(segments[p.segment], p))
        except Exception as exc:
            raise LoadFailed(
                f"reading shared memory failed: {exc!r}", wrote=sink.wrote, code="read_failed"
            ) from exc
    finally:
        _close(segments)
    return LoadStats(tensors=sink.tensors, bytes=sink.bytes, seconds=time.perf_counter() - t0)


class SharedTensors:
    """Tensors copied into one shared-memory segment, and the handles that describe them.

    Keep it alive until the update returns; ``close()`` (or ``with``) unlinks the segment.
    """

    def __init__(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(named.items() if isinstance(named, Mapping) else named)
        offsets, used = [], 0
        for _, t in items:
            used = -(-used // ALIGN) * ALIGN
            offsets.append(used)
            used += t.numel() * t.element_size()
        self.shm = shared_memory.SharedMemory(
            create=True, size=max(used, 1), name=PREFIX + secrets.token_hex(8)
        )
        self.tensors: list[dict[str, Any]] = []
        for (name, t), off in zip(items, offsets, strict=True):
            n = t.numel() * t.element_size()
            dst = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=n, offset=off) if n else None
            if dst is not None:
                dst.copy_(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
                del dst
            self.tensors.append(
                {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                 "handle": {"shm": self.shm.name, "offset": off}}
            )  # fmt: skip

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_tensors(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> SharedTensors:
    """Copy ``named`` into shared memory; post ``.tensors`` as ``update_weights_from_tensor``'s body."""
    return SharedTensors(named)


def iter_shared(source: TensorSource) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``source`` as owned copies (for engines that pull an iterator)."""
    placed = [_place(h) for h in source.tensors]
    segments: dict[str, shared_memory.SharedMemory] = {}
    try:
        for p in placed:
            if p.segment not in segments:
                segments[p.segment] = _open(p.segment)
            yield p.handle.spec.name, _view(segments[p.segment], p).clone()
    finally:
        _close(segments)
