"""A worker rank's side of a sharded plan (the protocol is :mod:`.protocol`'s): the checks
before the first collective (its place in the group, the sources' manifests, the go), the
receive of its transfers straight into the tensors it serves, and the verification of every
piece against its source's hashes."""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import torch
import xxhash

from weightsync.core.errors import (
    EngineUnavailable,
    IllegalState,
    InvalidRequest,
    LoadFailed,
    WeightSyncError,
)
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.value import Piece, PlanPart, Transfer
from weightsync.core.snapshot import TensorSpec
from weightsync.transports.copying import copy_into
from weightsync.transports.distributed.group import Group
from weightsync.transports.distributed.receiver import ReceiverGroup
from weightsync.transports.hashing import tensor_digest as digest
from weightsync.transports.plan.flight import Flight
from weightsync.transports.plan.pieces import Runs, message_bytes, piece_view
from weightsync.transports.plan.protocol import (
    go_key,
    manifest_key,
    manifest_sizes,
    ready_key,
    sums_by_piece,
    sums_key,
)
from weightsync.transports.plan.streams import Streams
from weightsync.transports.sink import torch_dtype

RECEIVE_DEPTH = 2

PlanGroup: TypeAlias = Group | ReceiverGroup
"""A group a plan is received on: one a helper process joined (gloo; every message lands in
the helper's shared buffers first, so a source that sends more bytes than declared aborts
the helper, never this process), or one this process joined itself (NCCL)."""


def placed_group(registry: Any, group_name: str, part: PlanPart) -> PlanGroup:
    """The group ``group_name`` of ``registry`` (one that may carry a plan:
    :meth:`~weightsync.transports.distributed.worker.GroupRegistry.plan_group`), checked to
    hold this worker (its rank 0) where ``part`` puts it.  Raises ``NotFound``
    (``unknown_group``) or ``InvalidRequest`` (``layout_mismatch``, ``unsafe_stream``,
    ``wrong_receiver``)."""
    group: PlanGroup = registry.plan_group(group_name)
    if group.rank != part.rank_offset or group.world_size != part.world_size:
        raise InvalidRequest(
            f"the plan puts this worker at group rank {part.rank_offset} of {part.world_size}; its rank 0 "
            f"is rank {group.rank} of {group.world_size} in group {group.name!r}",
            code="layout_mismatch",
        )
    return group


def _by_source(transfers: Sequence[Transfer]) -> list[tuple[int, list[Transfer]]]:
    by_src: dict[int, list[Transfer]] = {}
    for t in transfers:
        by_src.setdefault(t.src, []).append(t)
    return sorted(by_src.items())


def check_manifests(group: PlanGroup, stream_id: str, transfers: Sequence[Transfer]) -> None:
    """Compare every source's manifest with the transfers this rank expects from it.  Raises
    ``InvalidRequest`` (``stream_mismatch``) when one is missing or disagrees."""
    for src, mine in _by_source(transfers):
        key = manifest_key(stream_id, src)
        if not group.store.check([key]):
            raise InvalidRequest(
                f"stream {stream_id!r}: trainer rank {src} posted no manifest (it must before the update)",
                code="stream_mismatch",
            )
        theirs = manifest_sizes(group.store.get(key))
        for t in mine:
            if theirs.get(t.index) != t.size:
                raise InvalidRequest(
                    f"trainer rank {src} will send {theirs.get(t.index)} bytes as transfer {t.index}; "
                    f"the plan says {t.size}",
                    code="stream_mismatch",
                )


def handshake(group: PlanGroup, stream_id: str) -> None:
    """Mark this rank ready and wait for trainer rank 0's go.  Raises ``LoadFailed``
    (``stream_aborted``, ``wrote=False``)."""
    try:
        group.store.set(ready_key(stream_id, group.rank), b"1")
        group.store.wait([go_key(stream_id)], datetime.timedelta(seconds=group.timeout_s))
        go = group.store.get(go_key(stream_id))
    except Exception as exc:
        unavailable = EngineUnavailable(
            f"plan {stream_id!r} on group {group.name!r} never started: no go within {group.timeout_s}s ({exc})",
            code="stream_aborted",
        )
        raise LoadFailed(unavailable.message, wrote=False, cause=unavailable) from exc
    if go != b"1":
        aborted = IllegalState(
            "the trainer aborted the plan (another worker refused it)", code="stream_aborted"
        )
        raise LoadFailed(aborted.message, wrote=False, cause=aborted)


def expect_manifests(group: PlanGroup, stream_id: str, transfers: Sequence[Transfer]) -> None:
    """:func:`check_manifests`, with a store that failed as ``LoadFailed``
    (``stream_aborted``, ``wrote=False``)."""
    try:
        check_manifests(group, stream_id, transfers)
    except WeightSyncError:
        raise
    except Exception as exc:
        unavailable = EngineUnavailable(
            f"plan {stream_id!r}: the trainer's store failed ({exc})", code="stream_aborted"
        )
        raise LoadFailed(unavailable.message, wrote=False, cause=unavailable) from exc


def begin(group: PlanGroup, stream_id: str, transfers: Sequence[Transfer]) -> None:
    """Everything a worker rank does before the first collective of a plan: compare the
    sources' manifests with ``transfers`` (:func:`expect_manifests`), then :func:`handshake`.
    Raises ``InvalidRequest`` (``stream_mismatch``) or ``LoadFailed`` (``stream_aborted``,
    ``wrote=False``: the store failed, no go came, or the trainer aborted)."""
    expect_manifests(group, stream_id, transfers)
    handshake(group, stream_id)


def broke(registry: Any, group: PlanGroup, stream_id: str, exc: Exception) -> LoadFailed:
    """A plan that failed after its first collective: the group is out of step, so it is
    dropped from ``registry``; the error to raise (``stream_failed``, ``wrote=True``)."""
    registry._drop(group)
    return LoadFailed(
        f"plan {stream_id!r} on group {group.name!r} broke: {exc}", wrote=True, code="stream_failed"
    )


def in_step(exc: BaseException) -> bool:
    """Whether a plan whose receive raised ``exc`` after the go left its group in step: only
    when every message arrived and a piece failed its checksum (``checksum_mismatch``)."""
    return isinstance(exc, LoadFailed) and exc.code == "checksum_mismatch"


def settle(registry: Any, group: PlanGroup, stream_id: str, exc: Exception) -> WeightSyncError:
    """The error a plan whose receive raised ``exc`` after the go ends with: ``exc`` itself
    when it is of the family (the group dropped from ``registry`` unless :func:`in_step`: a
    helper that died, ``peer_failed``, or a collective that timed out leave it out of step),
    else :func:`broke`'s."""
    if isinstance(exc, WeightSyncError):
        if not in_step(exc):
            registry._drop(group)
        return exc
    return broke(registry, group, stream_id, exc)


def receive(
    group: PlanGroup,
    stream_id: str,
    transfers: Sequence[Transfer],
    specs: Mapping[str, TensorSpec],
    locals_: Mapping[str, tuple[torch.Tensor, Box]],
    on_write: Callable[[], None],
    on_piece: Callable[[Piece, bytes], None] | None = None,
    streams: Streams | None = None,
) -> Iterator[None]:
    """Receive ``transfers`` (this rank's, in plan order) into ``locals_`` (name -> the
    tensor this rank serves and its box), stepping after each message.  ``on_write`` is
    called once, before the first byte can land in a served tensor (a stream that fails
    before then wrote nothing); ``on_piece`` (if given) with each piece and the xxh3-64 of
    what landed, once it sits in its tensor; ``streams`` (if given) is fed every piece that
    is one run of its tensor's bytes, as it lands.  Verifies every piece against its
    source's hashes before it returns.

    On a group a helper process joined every message lands in the helper's two shared
    buffers (as large as the largest message) and is copied into place from there; on a
    group this process joined, a message that is one piece, contiguous in its tensor, is
    received straight into place.

    Raises ``LoadFailed`` (``checksum_mismatch``, ``wrote=True``) when a piece differs from
    what its source sent; ``PeerFailed`` when the helper died (a source sent more bytes than
    declared); any other failure propagates (the caller tears if it wrote, and drops the
    group)."""
    through_helper = isinstance(group, ReceiverGroup)
    bucket = max((t.size for t in transfers if through_helper or t.buffer >= 0), default=0)
    buffers = group.buffers(bucket) if bucket else []
    wrote: list[bool] = []

    def writing() -> None:
        if not wrote:
            wrote.append(True)
            on_write()

    got: dict[tuple[int, int], bytes] = {}  # (transfer index, piece position) -> hash
    # Two receives in flight (the next is posted while the previous lands and is unpacked);
    # packed receives alternate buffers 0 and 1 whatever the plan says, and Flight starts
    # each only once the previous receive into the same buffer has been unpacked.
    flight = Flight(group, depth=RECEIVE_DEPTH)

    runs = Runs(locals_, specs)
    left: dict[str, int] = {}  # pieces still to land, per tensor
    for t in transfers:
        for p in t.pieces:
            left[p.name] = left.get(p.name, 0) + 1

    def landed(p: Piece, h: bytes, run: tuple[np.ndarray, int] | None) -> None:
        if streams is not None:
            if run is None:
                streams.broken(p.name)
            else:
                streams.feed(p.name, run[0], run[1], p.nbytes)
        left[p.name] -= 1
        if not left[p.name]:
            runs.done(p.name)  # its memory is no longer held here (a pulling engine takes it)
        if on_piece is not None:
            on_piece(p, h)

    def unpack(t: Transfer, buf: torch.Tensor) -> None:
        writing()
        flat = buf.numpy() if buf.device.type == "cpu" else None
        for i, p in enumerate(t.pieces):
            run = runs.of(p) if flat is not None else None
            if run is not None:  # one run of bytes on the CPU: copied as bytes
                land = run[0][run[1] : run[1] + p.nbytes]
                np.copyto(land, flat[p.offset : p.offset + p.nbytes])  # type: ignore[index]
                h = xxhash.xxh3_64_digest(land)
            else:
                local, served = locals_[p.name]
                view = piece_view(local, served, p)
                raw = buf[p.offset : p.offset + p.nbytes]
                copy_into(view, raw.view(torch_dtype(specs[p.name].dtype)).reshape(p.box.shape))
                h = digest(view)
            got[(t.index, i)] = h  # what now sits in the weights, not the buffer
            landed(p, h, run)

    def received(t: Transfer, dest: torch.Tensor) -> None:
        h = got[(t.index, 0)] = digest(dest)
        landed(t.pieces[0], h, runs.of(t.pieces[0]))

    packed = 0
    for t in transfers:
        yield
        if t.buffer < 0 and not through_helper:
            p = t.pieces[0]
            local, served = locals_[p.name]
            view = piece_view(local, served, p)
            if view.is_contiguous() and view.device == group.device:  # straight into place
                writing()
                flight.add(
                    functools.partial(group.recv, message_bytes(view), t.src, t.index),
                    functools.partial(received, t, view),
                )
                continue
            scratch = torch.empty(t.size, dtype=torch.uint8, device=group.device)
            flight.add(
                functools.partial(group.recv, scratch, t.src, t.index), functools.partial(unpack, t, scratch)
            )
        else:
            # This rank picks its own buffer, alternating (as the source does): the plan's
            # ``buffer`` is not trusted, since two in-flight receives must never share one.
            buf = buffers[packed % 2][: t.size]
            packed += 1
            flight.add(functools.partial(group.recv, buf, t.src, t.index), functools.partial(unpack, t, buf))
    flight.drain()
    yield
    verify(group, stream_id, transfers, got)


def verify(
    group: PlanGroup, stream_id: str, transfers: Sequence[Transfer], got: dict[tuple[int, int], bytes]
) -> None:
    """Wait for each source's hashes and compare them with what arrived."""
    bad: list[str] = []
    for src, mine in _by_source(transfers):
        key = sums_key(stream_id, src)
        group.store.wait([key], datetime.timedelta(seconds=group.timeout_s))
        theirs = sums_by_piece(group.store.get(key))
        for t in mine:
            for i, p in enumerate(t.pieces):
                if theirs.get((t.index, i)) != got.get((t.index, i)):
                    bad.append(f"{p.name} {p.box.to_wire()}")
    if bad:
        raise LoadFailed(
            f"{len(bad)} piece(s) differ from what the trainer sent (xxh3-64), e.g. {bad[:3]}; the weights are torn",
            wrote=True,
            code="checksum_mismatch",
        )
