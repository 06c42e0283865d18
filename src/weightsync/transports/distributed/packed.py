"""weightsync's packed stream, the worker's side (see :mod:`.worker` for the protocol).

The trainer's manifest is checked against the worker's own plan of the declared metadata
(:func:`check_manifest`), the rank marks itself ready and waits for the go
(:func:`handshake`), then :func:`receive` takes the chunks, ``STREAM_DEPTH`` collectives in
flight: a large tensor straight into the engine's own memory (hashed there, on a thread,
once it is in), small ones in buckets (two reusable buffers) whose slices are copied into
the engine's tensors and hashed there in one pass (:func:`~.foreign.hand_over`).  Every
hash is compared with the trainer's (:func:`verify_sums`) before the stream ends.
"""

from __future__ import annotations

import datetime
import functools
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from weightsync.core.errors import EngineUnavailable, IllegalState, InvalidRequest, LoadFailed
from weightsync.core.snapshot import TensorSpec
from weightsync.transports.distributed import foreign
from weightsync.transports.distributed.drain import Progress
from weightsync.transports.distributed.group import Group, Window, stream_hasher
from weightsync.transports.distributed.keys import go_key, manifest_key, ready_key, sums_key
from weightsync.transports.distributed.layout import (
    STREAM_DEPTH,
    Bucket,
    Chunk,
    Direct,
    bucket_capacity,
    manifest,
)
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.sink import Target, torch_dtype


def check_manifest(group: Group, stream_id: str, chunks: Sequence[Chunk]) -> None:
    """Compare the trainer's manifest with our plan.  Raises ``InvalidRequest``
    (``stream_mismatch``) when it is missing or disagrees, before any collective."""
    key = manifest_key(stream_id)
    if not group.store.check([key]):
        raise InvalidRequest(
            f"stream {stream_id!r} has no manifest in group {group.name!r}: the trainer must post it "
            "before the update (use weightsync's Broadcaster)",
            code="stream_mismatch",
        )
    theirs, ours = group.store.get(key), manifest(chunks)
    if theirs != ours:
        got = struct.unpack(f"<{len(theirs) // 8}Q", theirs[: len(theirs) // 8 * 8]) if theirs else ()
        want = struct.unpack(f"<{len(chunks)}Q", ours)
        first = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        raise InvalidRequest(
            f"the trainer will send {len(got)} chunks totalling {sum(got)} bytes, the declared metadata "
            f"makes {len(want)} chunks totalling {sum(want)} bytes (first difference at chunk {first})",
            code="stream_mismatch",
        )


def verify_sums(group: Group, stream_id: str, specs: Sequence[TensorSpec], hashes: dict[str, str]) -> None:
    """Wait for the trainer's per-tensor hashes and compare them with ours.  Raises
    ``LoadFailed`` (``checksum_mismatch``, ``wrote=True``) when they differ."""
    key = sums_key(stream_id)
    group.store.wait([key], datetime.timedelta(seconds=group.timeout_s))
    theirs = group.store.get(key)
    ours = b"".join(bytes.fromhex(hashes[s.name]) for s in specs)
    if theirs != ours:
        bad = [s.name for i, s in enumerate(specs) if theirs[8 * i : 8 * i + 8] != ours[8 * i : 8 * i + 8]]
        raise LoadFailed(
            f"the bytes received differ from what the trainer sent: {len(bad)} tensor(s) fail their "
            f"xxh3-64 checksum, e.g. {bad[:5]}; the weights are torn",
            wrote=True,
            code="checksum_mismatch",
        )


def handshake(group: Group, stream_id: str) -> None:
    """Mark this rank ready and wait for rank 0's go.  Raises ``LoadFailed``
    (``stream_aborted``, ``wrote=False``): a 409 when rank 0 aborted, a 503 when it never
    decided or its store failed (nothing was received; the group stays)."""
    try:
        group.store.set(ready_key(stream_id, group.rank), b"1")
        group.store.wait([go_key(stream_id)], datetime.timedelta(seconds=group.timeout_s))
        go = group.store.get(go_key(stream_id))
    except Exception as exc:
        raise not_started(group, stream_id, exc) from exc
    if go != b"1":
        aborted = IllegalState(
            "the trainer aborted the stream (another worker refused it)", code="stream_aborted"
        )
        raise LoadFailed(aborted.message, wrote=False, cause=aborted)


def not_started(group: Group, stream_id: str, exc: Exception) -> LoadFailed:
    """A stream the trainer's store failed before the go: nothing was received (503)."""
    unavailable = EngineUnavailable(
        f"stream {stream_id!r} on group {group.name!r} never started: the trainer's store failed "
        f"or gave no go within {group.timeout_s}s ({exc})",
        code="stream_aborted",
    )
    return LoadFailed(unavailable.message, wrote=False, cause=unavailable)


def receive(
    group: Group,
    stream_id: str,
    chunks: Sequence[Chunk],
    specs: Sequence[TensorSpec],
    target: Target,
    in_target: set[str],
    progress: Progress,
) -> Iterator[None]:
    """The handshake, then every chunk into ``target``, stepping as they land; the hashes
    verified against the trainer's, then kept in ``target.hashes``.  ``in_target`` gets the
    names of the tensors hashed in the memory the target lent, after they were written;
    ``progress`` is owed from the go on, and says how many chunks were received however the
    stream ends (none is left in flight)."""
    buffers = group.buffers(bucket_capacity(chunks)) if bucket_capacity(chunks) else []
    handshake(group, stream_id)
    progress.owed = True  # rank 0 said go: it sends every chunk now
    hashes: dict[str, str] = {}
    later: dict[str, Future[str]] = {}
    # Tensors received alone are hashed on a helper thread (xxhash releases the GIL), so
    # the next receive is posted at once.
    window = Window(group, STREAM_DEPTH, buffers)
    try:
        yield from _chunks(window, chunks, target, hashes, later, in_target)
    finally:  # ended early (a failure, or a consumer that stopped): what was posted lands first
        window.settle()
        progress.taken, progress.broken = window.posted, window.broken
    hashes.update((name, f.result()) for name, f in later.items())
    verify_sums(group, stream_id, specs, hashes)
    target.hashes.update(hashes)


def _chunks(
    window: Window,
    chunks: Sequence[Chunk],
    target: Target,
    hashes: dict[str, str],
    later: dict[str, Future[str]],
    in_target: set[str],
) -> Iterator[None]:
    """Post every chunk on ``window``, each one's follow-up handing it to ``target`` (the
    tensors received alone are hashed into ``later``, and are by the time this ends)."""
    group = window.group
    with stream_hasher() as hasher:
        for chunk in chunks:
            window.make_room()
            yield  # what finished collectives handed over reaches a pulling engine now
            if isinstance(chunk, Direct):
                t = target.buffer(chunk.spec, group.device)  # the engine's tensor: no copy
                lent = t is not None
                if t is None:
                    t = torch.empty(
                        chunk.spec.shape, dtype=torch_dtype(chunk.spec.dtype), device=group.device
                    )
                done = functools.partial(
                    direct_done, target, later, hasher, chunk, t, in_target if lent else None
                )
                window.post(t, done)
            else:
                buf = window.refill()  # its previous bucket is received and unpacked
                window.post(
                    buf[: chunk.size],
                    functools.partial(unpack, target, hashes, buf, chunk, group.device, in_target),
                )
        window.drain()
        yield


def direct_done(
    target: Target,
    later: dict[str, Future[str]],
    hasher: ThreadPoolExecutor,
    chunk: Direct,
    t: torch.Tensor,
    in_target: set[str] | None = None,
) -> None:
    """A tensor received alone is in: hand it over, and hash it on ``hasher`` (in the
    target's memory when it was lent: ``in_target`` then gets its name)."""
    target.accept(chunk.spec, t, None)
    later[chunk.spec.name] = hasher.submit(tensor_hash, t)
    if in_target is not None:
        in_target.add(chunk.spec.name)


def unpack(
    target: Target,
    hashes: dict[str, str],
    buf: torch.Tensor,
    bucket: Bucket,
    device: torch.device,
    in_target: set[str] | None = None,
) -> None:
    """A bucket is in: each slice copied into the engine's tensor and hashed in one pass."""
    for slot in bucket.slots:
        raw = buf[slot.offset : slot.offset + slot.nbytes]
        hashes[slot.spec.name] = foreign.hand_over(target, slot.spec, raw, device, in_target)
