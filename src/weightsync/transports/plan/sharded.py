"""Running a sharded transfer plan (:mod:`weightsync.core.plan.build`) on a weight-update group.

The trainer ranks and the worker ranks are one group (trainer rank ``s`` is group rank
``s``; see :class:`~weightsync.core.plan.value.Plan` for the workers').  Every transfer is one
point-to-point message (``send``/``recv`` on the group's process group, tagged with the
transfer's index), not a broadcast on a subgroup: each (source, destination) pair carries
different bytes, so a broadcast would need one communicator per pair — hundreds at fleet
scale, each a rendezvous — while point-to-point reuses the one group, sends each byte only
where it is served, and lets the plan's rounds keep every link busy at once.  Ranks work
through their own transfers in the plan's global order, two in flight (double-buffered:
the next message is packed or received while the previous one is on the wire).

The protocol for one update, keyed by ``stream_id`` in the group's store:

1. each source puts its *manifest* (``index, size`` of each transfer it will send, u64
   pairs) before the workers are asked; a worker compares the manifests of every source it
   hears from with its part of the plan and refuses any difference (400 ``stream_mismatch``)
   before the first collective — a wrong size would otherwise tear or abort the receive;
2. every worker rank marks itself ready; trainer rank 0 says go once all are, or abort as
   soon as one refused (every source waits for that word too);
3. the messages flow; a worker copies each piece straight into the box of the served (or
   staged) tensor it belongs to and hashes the piece's bytes (xxh3-64);
4. after its last message each source puts the hashes of its pieces (8 bytes each, in
   transfer then piece order); the update succeeds only if every piece a worker received
   hashes the same (else ``checksum_mismatch``: torn, never committed).

A worker rank's digest is that of what it serves: it hashes each tensor it
holds (its TP shard, or the whole tensor) as the engine reports it for any other load (a
one-process worker hashes each tensor on a helper thread once its last piece landed).
"""

from __future__ import annotations

import datetime
import functools
import struct
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash

from weightsync.core.errors import EngineUnavailable, IllegalState, InvalidRequest, LoadFailed
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.value import Piece, Transfer
from weightsync.core.snapshot import TensorSpec
from weightsync.transports.copying import copy_into
from weightsync.transports.distributed.group import Group
from weightsync.transports.hashing import tensor_digest as digest
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.sink import torch_dtype

RECEIVE_DEPTH = 2


def manifest_key(stream_id: str, src: int) -> str:
    return f"weightsync/plan/{stream_id}/manifest/{src}"


def ready_key(stream_id: str, rank: int) -> str:
    return f"weightsync/plan/{stream_id}/ready/{rank}"


def go_key(stream_id: str) -> str:
    return f"weightsync/plan/{stream_id}/go"


def sums_key(stream_id: str, src: int) -> str:
    return f"weightsync/plan/{stream_id}/sums/{src}"


def manifest(transfers: Sequence[Transfer]) -> bytes:
    """What a source says it will send: ``index, size`` per transfer, little-endian u64s."""
    return b"".join(struct.pack("<QQ", t.index, t.size) for t in transfers)


def piece_view(local: torch.Tensor, served: Box, piece: Piece) -> torch.Tensor:
    """The elements of ``piece`` inside ``local`` (a tensor holding box ``served``)."""
    rel = piece.box.relative_to(served)
    return local[tuple(slice(a, b) for a, b in rel.bounds)]


def run_start(shape: Sequence[int], served: Box, box: Box, itemsize: int) -> int | None:
    """Where ``box`` (inside ``served``, the box a contiguous tensor of ``shape`` holds) starts
    in that tensor's bytes, when its elements are one contiguous run of them; else ``None``.
    A box is one run when every dimension before its first longer than one element has one
    element, and every dimension after it is whole."""
    start, stride, whole_after = 0, itemsize, True
    for d in range(len(shape) - 1, -1, -1):
        lo, hi = box.bounds[d]
        o = served.bounds[d][0]
        if not whole_after and hi - lo != 1:
            return None
        if (lo - o, hi - o) != (0, shape[d]):
            whole_after = False
        start += (lo - o) * stride
        stride *= shape[d]
    return start


def flat_bytes(t: torch.Tensor) -> np.ndarray | None:
    """``t``'s memory as flat bytes (a numpy view, no copy) when it is contiguous on the CPU
    and holds plain values (no lazy conjugate or negative view); ``None`` otherwise."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 or t.is_conj() or t.is_neg():
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()


class _Runs:
    """Each tensor's bytes (:func:`flat_bytes`, made once per tensor) and where each piece
    lies in them."""

    def __init__(
        self, tensors: Mapping[str, tuple[torch.Tensor, Box]], specs: Mapping[str, TensorSpec]
    ) -> None:
        self.tensors, self.specs = tensors, specs
        self.flat: dict[str, np.ndarray | None] = {}

    def done(self, name: str) -> None:
        """Forget ``name``'s bytes (no more pieces of it will land)."""
        self.flat.pop(name, None)

    def of(self, p: Piece) -> tuple[np.ndarray, int] | None:
        """``(the tensor's bytes, where the piece starts in them)`` when the piece is one run
        of a plain CPU tensor of its spec's dtype; ``None`` otherwise."""
        if p.name not in self.flat:
            t, _ = self.tensors[p.name]
            ok = t.dtype == torch_dtype(self.specs[p.name].dtype)
            self.flat[p.name] = flat_bytes(t) if ok else None
        flat = self.flat[p.name]
        if flat is None:
            return None
        t, served = self.tensors[p.name]
        start = run_start(t.shape, served, p.box, t.element_size())
        if start is None or start + p.nbytes > flat.nbytes:
            return None
        return flat, start


class Streams:
    """A streaming xxh3-64 of each tensor a rank serves, fed by its pieces as they land
    (while their bytes are still in cache), so that a tensor that arrived in pieces needs no
    second pass over its memory.  A piece that lands ahead of the bytes before it waits and
    is fed from the tensor's memory once they are in.  :meth:`result` is the hash of a
    tensor whose pieces fed its stream exactly once each, in order, without a gap, from the
    first byte to the last; ``None`` for any other (a piece that is not one run, pieces that
    overlap or leave a gap): such a tensor must be hashed whole."""

    def __init__(self) -> None:
        # name -> (stream, bytes fed so far, runs landed ahead: start -> length); None once
        # the tensor cannot be streamed.
        self.state: dict[str, tuple[xxhash.xxh3_64, list[int], dict[int, int]] | None] = {}

    def broken(self, name: str) -> None:
        self.state[name] = None

    def feed(self, name: str, flat: np.ndarray, start: int, nbytes: int) -> None:
        """The piece of ``name`` at bytes ``start .. start + nbytes`` of ``flat`` (the whole
        tensor's bytes) has landed."""
        if name not in self.state:
            self.state[name] = (xxhash.xxh3_64(), [0], {})
        state = self.state[name]
        if state is None:
            return
        h, fed, ahead = state
        if start != fed[0]:
            if start < fed[0] or start in ahead:  # overlaps what was fed or landed
                self.state[name] = None
            else:
                ahead[start] = nbytes
            return
        h.update(flat[start : start + nbytes])
        fed[0] += nbytes
        while fed[0] in ahead:  # pieces that landed ahead of this one, now in order
            n = ahead.pop(fed[0])
            h.update(flat[fed[0] : fed[0] + n])
            fed[0] += n

    def result(self, name: str, nbytes: int) -> str | None:
        state = self.state.get(name)
        if state is None or state[1][0] != nbytes or state[2]:
            return None
        return state[0].hexdigest()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes (messages are bytes on both sides)."""
    return t.reshape(-1).view(torch.uint8)


class Flight:
    """At most ``depth`` point-to-point operations in flight; each finished one runs its
    follow-up.  (The plan's global order makes any depth deadlock-free.)

    :meth:`add` takes the operation *unstarted*: it is started only once there is room, so
    when it starts, the operation two back (same depth 2) has finished and run its follow-up.
    That is what makes a buffer safe to reuse: the destination's packing buffers alternate,
    so a receive into buffer 0 starts only after the previous receive into buffer 0 was
    waited for and unpacked.  (Starting it first, then making room, let a receive overwrite
    a buffer whose bytes were still being unpacked: corrupt pieces, which the checksums
    caught, with two receives in flight.)"""

    def __init__(self, group: Group, depth: int = 2) -> None:
        self.group, self.depth = group, depth
        self.pending: deque[tuple[Any, Callable[[], None] | None]] = deque()

    def make_room(self) -> None:
        while len(self.pending) >= self.depth:
            self._finish_oldest()

    def add(self, start: Callable[[], Any], then: Callable[[], None] | None = None) -> None:
        self.make_room()
        self.pending.append((start(), then))

    def drain(self) -> None:
        while self.pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, then = self.pending.popleft()
        self.group.wait(work)
        if then is not None:
            then()


# ---------------------------------------------------------------------------- worker side


def check_manifests(group: Group, stream_id: str, transfers: Sequence[Transfer]) -> None:
    """Compare every source's manifest with the transfers this rank expects from it.  Raises
    ``InvalidRequest`` (``stream_mismatch``) when one is missing or disagrees."""
    by_src: dict[int, list[Transfer]] = {}
    for t in transfers:
        by_src.setdefault(t.src, []).append(t)
    for src, mine in sorted(by_src.items()):
        key = manifest_key(stream_id, src)
        if not group.store.check([key]):
            raise InvalidRequest(
                f"stream {stream_id!r}: trainer rank {src} posted no manifest (it must before the update)",
                code="stream_mismatch",
            )
        raw = group.store.get(key)
        theirs = dict(struct.iter_unpack("<QQ", raw[: len(raw) // 16 * 16]))
        for t in mine:
            if theirs.get(t.index) != t.size:
                raise InvalidRequest(
                    f"trainer rank {src} will send {theirs.get(t.index)} bytes as transfer {t.index}; "
                    f"the plan says {t.size}",
                    code="stream_mismatch",
                )


def handshake(group: Group, stream_id: str) -> None:
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


def expect_manifests(group: Group, stream_id: str, transfers: Sequence[Transfer]) -> None:
    """:func:`check_manifests`, with a store that failed as ``LoadFailed``
    (``stream_aborted``, ``wrote=False``)."""
    from weightsync.core.errors import WeightSyncError

    try:
        check_manifests(group, stream_id, transfers)
    except WeightSyncError:
        raise
    except Exception as exc:
        unavailable = EngineUnavailable(
            f"plan {stream_id!r}: the trainer's store failed ({exc})", code="stream_aborted"
        )
        raise LoadFailed(unavailable.message, wrote=False, cause=unavailable) from exc


def begin(group: Group, stream_id: str, transfers: Sequence[Transfer]) -> None:
    """Everything a worker rank does before the first collective of a plan: compare the
    sources' manifests with ``transfers`` (:func:`expect_manifests`), then :func:`handshake`.
    Raises ``InvalidRequest`` (``stream_mismatch``) or ``LoadFailed`` (``stream_aborted``,
    ``wrote=False``: the store failed, no go came, or the trainer aborted)."""
    expect_manifests(group, stream_id, transfers)
    handshake(group, stream_id)


def broke(registry: Any, group: Group, stream_id: str, exc: Exception) -> LoadFailed:
    """A plan that failed after its first collective: the group is out of step, so it is
    dropped from ``registry``; the error to raise (``stream_failed``, ``wrote=True``)."""
    registry._drop(group)
    return LoadFailed(
        f"plan {stream_id!r} on group {group.name!r} broke: {exc}", wrote=True, code="stream_failed"
    )


def receive(
    group: Group,
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
    called before the first byte can land in a served tensor; ``on_piece`` (if given) with
    each piece and the xxh3-64 of what landed, once it sits in its tensor; ``streams`` (if
    given) is fed every piece that is one run of its tensor's bytes, as it lands.  Verifies
    every piece against its source's hashes before it returns.

    Raises ``LoadFailed`` (``checksum_mismatch``, ``wrote=True``) when a piece differs from
    what its source sent; any other failure propagates (the caller tears and drops the group)."""
    bucket = max((t.size for t in transfers if t.buffer >= 0), default=0)
    buffers = group.buffers(bucket) if bucket else []
    got: dict[tuple[int, int], bytes] = {}  # (transfer index, piece position) -> hash
    # Two receives in flight (the next is posted while the previous lands and is unpacked);
    # packed receives alternate buffers 0 and 1 whatever the plan says, and Flight starts
    # each only once the previous receive into the same buffer has been unpacked.
    flight = Flight(group, depth=RECEIVE_DEPTH)

    runs = _Runs(locals_, specs)
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

    on_write()
    packed = 0
    for t in transfers:
        yield
        if t.buffer < 0:
            p = t.pieces[0]
            local, served = locals_[p.name]
            view = piece_view(local, served, p)
            if view.is_contiguous() and view.device == group.device:  # straight into place
                flight.add(
                    functools.partial(group.recv, _bytes(view), t.src, t.index),
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
    group: Group, stream_id: str, transfers: Sequence[Transfer], got: dict[tuple[int, int], bytes]
) -> None:
    """Wait for each source's hashes and compare them with what arrived."""
    by_src: dict[int, list[Transfer]] = {}
    for t in transfers:
        by_src.setdefault(t.src, []).append(t)
    bad: list[str] = []
    for src, mine in sorted(by_src.items()):
        key = sums_key(stream_id, src)
        group.store.wait([key], datetime.timedelta(seconds=group.timeout_s))
        theirs = _sums_by_piece(group.store.get(key), group, stream_id, src)
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


def _sums_by_piece(raw: bytes, group: Group, stream_id: str, src: int) -> dict[tuple[int, int], bytes]:
    """A source's hashes: ``index, position`` (u64 each) then 8 bytes of hash, per piece."""
    out: dict[tuple[int, int], bytes] = {}
    for off in range(0, len(raw) // 24 * 24, 24):
        index, pos = struct.unpack_from("<QQ", raw, off)
        out[(index, pos)] = raw[off + 16 : off + 24]
    return out


# ---------------------------------------------------------------------------- trainer side


def check_held(specs: Mapping[str, TensorSpec], held: Mapping[str, tuple[torch.Tensor, Box]]) -> None:
    """Raises ``InvalidRequest`` (``stream_mismatch``) when a held tensor's dtype or shape
    disagrees with its box (a source checks this before it posts its manifest)."""
    for name, (t, box) in held.items():
        if tuple(t.shape) != box.shape or t.dtype != torch_dtype(specs[name].dtype):
            raise InvalidRequest(
                f"{name}: this rank holds {t.dtype} {list(t.shape)}, its layout says "
                f"{specs[name].dtype} {list(box.shape)}",
                code="stream_mismatch",
            )


def send(
    group: Group,
    transfers: Sequence[Transfer],
    specs: Mapping[str, TensorSpec],
    held: Mapping[str, tuple[torch.Tensor, Box]],
    go: Callable[[], bool] | None = None,
) -> bytes | None:
    """Send this source's ``transfers`` (in plan order) from ``held`` (name -> the tensor
    this rank holds and its box).  Returns the hashes to put under :func:`sums_key`.

    ``go`` (if given) is called once the first two packed messages are packed and hashed,
    before the first message is sent: the packing overlaps the workers' handshake.  When it
    returns false nothing is sent and ``None`` is returned.

    Raises ``InvalidRequest`` (``stream_mismatch``) before the first message when a held
    tensor's dtype or shape disagrees with its box."""
    check_held(specs, held)
    bucket = max((t.size for t in transfers if t.buffer >= 0), default=0)
    buffers = group.buffers(bucket) if bucket else []
    sums: list[bytes] = []
    runs = _Runs(held, specs)
    flight = Flight(group)
    # A source sends the same pieces to every destination that serves them (replicas): a
    # buffer that already holds exactly this transfer's pieces is sent again as it is, and a
    # piece's hash is taken once per push.
    in_buffer: list[tuple[tuple[Piece, ...], list[bytes]] | None] = [None, None]
    direct_sums: dict[tuple[str, Box], bytes] = {}

    def pack(slot: int, t: Transfer) -> list[bytes]:
        """Fill buffer ``slot`` with ``t``'s pieces (unless it holds them already); their hashes."""
        buf = buffers[slot]
        held_now = in_buffer[slot]
        if held_now is None or held_now[0] != t.pieces:
            hashes = []
            flat = buf.numpy() if buf.device.type == "cpu" else None
            for p in t.pieces:
                run = runs.of(p) if flat is not None else None
                if run is not None:  # one run of bytes on the CPU: copied as bytes
                    out_np = flat[p.offset : p.offset + p.nbytes]  # type: ignore[index]
                    np.copyto(out_np, run[0][run[1] : run[1] + p.nbytes])
                    hashes.append(xxhash.xxh3_64_digest(out_np))
                    continue
                local, box = held[p.name]
                out = buf[p.offset : p.offset + p.nbytes]
                copy_into(out.view(local.dtype).reshape(p.box.shape), piece_view(local, box, p))
                hashes.append(digest(out))
            held_now = in_buffer[slot] = (t.pieces, hashes)
        return held_now[1]

    # The first packed message of each buffer is packed before the go.
    ahead: dict[int, list[bytes]] = {}
    for t in transfers:
        if len(ahead) == 2:
            break
        if t.buffer >= 0:
            ahead[t.index] = pack(len(ahead), t)
    if go is not None and not go():
        return None
    packed = 0
    for t in transfers:
        if t.buffer < 0:
            p = t.pieces[0]
            local, box = held[p.name]
            src = piece_view(local, box, p).to(group.device).contiguous()
            # the message keeps its tensor alive until it is sent
            flight.add(functools.partial(group.send, _bytes(src), t.dst, t.index), lambda src=src: None)
            key = (p.name, p.box)
            if key not in direct_sums:
                direct_sums[key] = digest(src)
            sums.append(struct.pack("<QQ", t.index, 0) + direct_sums[key])
            continue
        slot = packed % 2
        packed += 1
        hashes = ahead.pop(t.index, None)
        if hashes is None:
            flight.make_room()  # this buffer's previous send is done before it is refilled
            hashes = pack(slot, t)
        sums.extend(struct.pack("<QQ", t.index, i) + h for i, h in enumerate(hashes))
        flight.add(functools.partial(group.send, buffers[slot][: t.size], t.dst, t.index))
    flight.drain()
    return b"".join(sums)


# ---------------------------------------------------------------------------- the worker's reader


class _WholeHashes:
    """The hash of every tensor a one-process worker serves, as it now holds it: a tensor that
    arrived as one piece covering all of it takes that piece's hash (the same bytes, hashed
    once); one that arrived in pieces takes its :class:`Streams` hash, fed as they landed; any
    other is hashed whole on ``hasher`` (a helper thread) once its last piece has landed,
    while the rest of the plan is still arriving."""

    def __init__(
        self, targets: Mapping[str, torch.Tensor], transfers: Sequence[Transfer], hasher: ThreadPoolExecutor
    ) -> None:
        self.targets, self.hasher = targets, hasher
        self.streams = Streams()
        self.left: dict[str, int] = {}
        for t in transfers:
            for p in t.pieces:
                self.left[p.name] = self.left.get(p.name, 0) + 1
        self.pieces = dict(self.left)
        self.hashes: dict[str, str | Future[str]] = {}

    def landed(self, piece: Piece, digest: bytes) -> None:
        self.left[piece.name] -= 1
        if self.left[piece.name]:
            return
        t = self.targets[piece.name]
        if self.pieces[piece.name] == 1 and piece.box.shape == tuple(t.shape) and t.is_contiguous():
            self.hashes[piece.name] = digest.hex()
            return
        streamed = self.streams.result(piece.name, t.numel() * t.element_size())
        self.hashes[piece.name] = streamed if streamed is not None else self.hasher.submit(tensor_hash, t)

    def result(self, names: Sequence[str]) -> dict[str, str]:
        """Every one of ``names``'s hash (one the plan sent nothing of, being empty, hashed now)."""
        out = {}
        for n in names:
            h = self.hashes.get(n)
            out[n] = tensor_hash(self.targets[n]) if h is None else h if isinstance(h, str) else h.result()
        return out


class PlanReader:
    """The plan channel for a worker whose one process serves every tensor whole: checks its
    part of the plan against the engine's weights (:func:`~weightsync.core.plan.check.check_part`)
    and the sources' manifests, then receives each piece straight into the target's tensors.

    Raises (``validate``) ``InvalidRequest`` (``layout_mismatch``) before anything moves;
    (``stream``) ``InvalidRequest`` (``stream_mismatch``) or ``LoadFailed`` (``stream_aborted``)
    before the first collective, ``LoadFailed`` (``stream_failed``, the group dropped; or
    ``checksum_mismatch``) after it."""

    kind = "plan"

    def __init__(self, registry: Any, source: Any) -> None:
        self.registry = registry
        self.source = source
        self._group: Group | None = None
        self._transfers: tuple[Transfer, ...] = ()
        self._specs: dict[str, TensorSpec] = {}

    def validate(self, specs: Mapping[str, TensorSpec]) -> None:
        from weightsync.core.plan.check import check_part

        part = self.source.part
        group = self.registry.get(self.source.group_name)
        if group.rank != part.rank_offset or group.world_size != part.world_size:
            raise InvalidRequest(
                f"the plan puts this worker at group rank {part.rank_offset} of {part.world_size}; it is rank "
                f"{group.rank} of {group.world_size} in group {group.name!r}",
                code="layout_mismatch",
            )
        served = [{name: Box.full(spec.shape) for name, spec in specs.items()}]
        check_part(part, served, list(specs.values()))
        self._group, self._specs = group, dict(specs)
        self._transfers = part.for_rank(0)

    def stream(self, target: Any) -> Iterator[None]:
        from weightsync.core.errors import NotSupported, WeightSyncError
        from weightsync.transports.sink import TensorSink

        group = self._group
        assert group is not None, "validate first"
        # Only a plain sink over the served (or staged) tensors themselves: a sink that
        # forwards to other ranks (a tensor-parallel engine's) would not see the pieces land.
        if type(target) is not TensorSink or any(t.device.type == "meta" for t in target.targets.values()):
            raise NotSupported(
                "this engine cannot receive a sharded plan into its weights (one-process workers only)",
                code="not_supported",
            )
        sid = self.source.stream_id
        begin(group, sid, self._transfers)
        names = [s.name for s in self.source.part.tensors]
        locals_ = {n: (target.targets[n], Box.full(self._specs[n].shape)) for n in names}

        def wrote() -> None:
            target.wrote = True

        with ThreadPoolExecutor(1, thread_name_prefix="weightsync-hash") as hasher:
            whole = _WholeHashes(target.targets, self._transfers, hasher)
            try:
                yield from receive(
                    group, sid, self._transfers, self._specs, locals_, wrote, whole.landed, whole.streams
                )
            except WeightSyncError:
                raise  # a checksum mismatch: the group is still in step
            except Exception as exc:
                raise broke(self.registry, group, sid, exc) from exc
            hashes = whole.result(names)
        for n in names:  # the digest is that of what this worker now serves
            t = target.targets[n]
            target.hashes[n] = hashes[n]
            target.written.append(n)
            target.tensors += 1
            target.bytes += t.numel() * t.element_size()

    def close(self) -> None:
        """Nothing is held between validation and the stream."""
