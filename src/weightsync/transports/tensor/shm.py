"""Tensor transport over POSIX shared memory, for a trainer colocated with the worker.

The trainer copies its tensors once into a shared-memory segment (:func:`weightsync.trainer.share_tensors`) and
posts ``update_weights_from_tensor`` with one handle per tensor,
``{"shm": "<segment>", "offset": <bytes>}``; the worker copies each tensor from the segment
straight into the engine.  Everything is checked before the first write: every segment name
is a weightsync name (a request cannot make the worker read arbitrary shared memory), every
segment opens read-only, is a non-empty regular file with no other name (a hard link would
let the name rule vouch for someone else's segment) and holds every tensor placed in it,
and names, shapes and dtypes fit the engine.  CUDA IPC handles (``{"cuda_ipc": ...}``) are
refused with 501 for now.

The segment is never mapped: bytes are read with bounded ``preadv`` calls.  The trainer owns
the segment and may shrink it at any time; a mapping would then fault (SIGBUS kills the
process), whereas a read just comes back short, which is a clean ``LoadFailed``.  The size is
also checked again (``fstat``) before every tensor.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from weightsync.core.dtypes import itemsize
from weightsync.core.errors import InvalidRequest, LoadFailed, NotFound, NotSupported, WeightSyncError
from weightsync.core.sources import TensorHandle, TensorSource
from weightsync.core.validation import unique_tensor_names
from weightsync.transports.hashing import hasher
from weightsync.transports.sink import Target, check_metadata, torch_dtype

PREFIX = "weightsync_"
SHM_DIR = "/dev/shm"
"""Where Linux keeps POSIX shared memory (``shm_open(name)`` is ``open(SHM_DIR/name)``)."""
_NAME = re.compile(r"weightsync_[A-Za-z0-9_-]{1,200}")
CHUNK_BYTES = 8 << 20
"""The most one read copies; a segment that shrinks is noticed within one chunk."""


@attrs.frozen
class _Placed:
    handle: TensorHandle
    segment: str
    offset: int
    nbytes: int


class _Segment:
    """A segment opened read-only (never mapped: see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        if not _NAME.fullmatch(name):
            raise InvalidRequest(
                f"shared-memory segment {name[:80]!r} is not a weightsync segment (want "
                f"{PREFIX!r} followed by 1-200 letters, digits, '_' or '-')",
                code="invalid_value",
            )
        try:
            # O_NONBLOCK: a FIFO planted under the name must not block the open.
            self.fd = os.open(
                os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            )
        except FileNotFoundError:
            raise NotFound(f"no shared-memory segment {name!r}", code="segment_not_found") from None
        except OSError as exc:
            raise InvalidRequest(
                f"shared-memory segment {name!r} cannot be opened: {exc.strerror}", code="invalid_segment"
            ) from None
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(
                    f"shared-memory segment {name!r} is not a regular segment", code="invalid_segment"
                )
            if st.st_size == 0:
                raise InvalidRequest(f"shared-memory segment {name!r} is empty", code="invalid_segment")
            if st.st_nlink != 1:  # a hard link: the name rule would vouch for another segment
                raise InvalidRequest(
                    f"shared-memory segment {name!r} has {st.st_nlink} names (a hard link to another "
                    "segment is not a weightsync segment)",
                    code="invalid_segment",
                )
        except BaseException:
            self.close()
            raise

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:  # a stream abandoned before its first item still closes its fd
        with contextlib.suppress(Exception):
            self.close()

    def read_into(self, p: _Placed, dst: torch.Tensor, digest: Any | None = None) -> None:
        """Copy ``p``'s bytes into ``dst`` (``p.nbytes`` contiguous bytes), feeding ``digest``
        (a :func:`~weightsync.transports.hashing.hasher`).

        Raises ``LoadFailed`` (``segment_shrunk``, ``wrote=True``: ``dst`` may be half
        written) when the segment no longer holds them."""
        if self.size() < p.offset + p.nbytes:
            raise _shrunk(p, self.size())
        view = dst.detach().reshape(-1).view(torch.uint8).numpy().data
        done = 0
        while done < p.nbytes:
            part = view[done : min(done + CHUNK_BYTES, p.nbytes)]
            got = os.preadv(self.fd, [part], p.offset + done)
            if got <= 0:
                raise _shrunk(p, self.size())
            if digest is not None:
                digest.update(part[:got])
            done += got


def _shrunk(p: _Placed, size: int) -> LoadFailed:
    return LoadFailed(
        f"{p.handle.spec.name}: shared-memory segment {p.segment!r} shrank to {size} bytes while it "
        f"was read (the tensor needs bytes {p.offset}..{p.offset + p.nbytes})",
        wrote=True,
        code="segment_shrunk",
    )


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
    nbytes = math.prod(handle.spec.shape) * itemsize(handle.spec.dtype)
    return _Placed(handle, h["shm"], h["offset"], nbytes)


def _close(segments: dict[str, _Segment]) -> None:
    for seg in segments.values():
        seg.close()


def _validate(
    source: TensorSource, sink_specs: Mapping[str, Any] | None
) -> tuple[list[_Placed], dict[str, _Segment]]:
    """Check every handle and open (and bounds-check) every segment, before any byte is copied.

    Raises a 4xx error of the family; any other exception raised while validating becomes
    ``InvalidRequest`` (``invalid_handle``), so a refused request never looks like a write."""
    segments: dict[str, _Segment] = {}
    try:
        unique_tensor_names("tensors", (h.spec.name for h in source.tensors))  # a wire source too
        if sink_specs is not None:
            check_metadata((h.spec for h in source.tensors), sink_specs, allow_partial=True)
        placed = [_place(h) for h in source.tensors]
        for p in placed:
            if p.segment not in segments:
                segments[p.segment] = _Segment(p.segment)
            size = segments[p.segment].size()
            if p.offset + p.nbytes > size:
                raise InvalidRequest(
                    f"{p.handle.spec.name}: bytes {p.offset}..{p.offset + p.nbytes} lie outside segment "
                    f"{p.segment!r} ({size} bytes)",
                    code="invalid_value",
                )
    except BaseException as exc:
        _close(segments)
        if isinstance(exc, WeightSyncError) or not isinstance(exc, Exception):
            raise
        raise InvalidRequest(f"invalid tensor handle: {exc!r}", code="invalid_handle") from exc
    return placed, segments


class SharedReader:
    """The shared-memory channel: :meth:`validate` (every handle, every segment opened
    read-only and bounds-checked, names, shapes and dtypes; nothing written), then
    :meth:`stream`.  Segments stay open from validation to the end of the stream."""

    kind = TensorSource.kind

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        self._placed: list[_Placed] = []
        self._segments: dict[str, _Segment] = {}

    def validate(self, specs: Mapping[str, Any]) -> None:
        """Check every handle against ``specs``.  Raises a 4xx error of the family (any other
        exception becomes ``InvalidRequest``, ``invalid_handle``); returns ``None``: a
        segment declares no hashes."""
        self.close()
        self._placed, self._segments = _validate(self.source, specs)

    def stream(self, target: Target) -> Iterator[None]:
        """Copy each tensor into the memory ``target`` lends (else a fresh tensor), hashing
        it on the way; a segment that shrank raises ``LoadFailed`` (``segment_shrunk``)."""
        cpu = torch.device("cpu")
        try:
            for p in self._placed:
                spec = p.handle.spec
                digest = hasher()
                dst = target.buffer(spec, cpu)
                if dst is None:
                    dst = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
                self._segments[p.segment].read_into(p, dst, digest)
                target.accept(spec, dst, digest.hexdigest())
                yield
        finally:
            self.close()

    def close(self) -> None:
        _close(self._segments)
