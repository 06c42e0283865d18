"""A source's side of a sharded plan (a trainer rank; the protocol is :mod:`.protocol`'s):
pack its transfers from the tensors it holds, send them, and return the pieces' hashes it
then posts."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import xxhash

from weightsync.core.errors import InvalidRequest
from weightsync.core.plan.boxes import Box
from weightsync.core.plan.value import Piece, Transfer
from weightsync.core.snapshot import TensorSpec
from weightsync.transports.copying import copy_into
from weightsync.transports.distributed.group import Group
from weightsync.transports.hashing import tensor_digest as digest
from weightsync.transports.plan.flight import Flight
from weightsync.transports.plan.pieces import Runs, message_bytes, piece_view
from weightsync.transports.plan.protocol import piece_sum
from weightsync.transports.sink import torch_dtype


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
    this rank holds and its box).  Returns the hashes to put under
    :func:`~.protocol.sums_key`.

    ``go`` (if given) is called once the first two packed messages are packed and hashed,
    before the first message is sent: the packing overlaps the workers' handshake.  When it
    returns false nothing is sent and ``None`` is returned.

    Raises ``InvalidRequest`` (``stream_mismatch``) before the first message when a held
    tensor's dtype or shape disagrees with its box."""
    check_held(specs, held)
    bucket = max((t.size for t in transfers if t.buffer >= 0), default=0)
    buffers = group.buffers(bucket) if bucket else []
    sums: list[bytes] = []
    runs = Runs(held, specs)
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
            flight.add(
                functools.partial(group.send, message_bytes(src), t.dst, t.index), lambda src=src: None
            )
            key = (p.name, p.box)
            if key not in direct_sums:
                direct_sums[key] = digest(src)
            sums.append(piece_sum(t.index, 0, direct_sums[key]))
            continue
        slot = packed % 2
        packed += 1
        hashes = ahead.pop(t.index, None)
        if hashes is None:
            flight.make_room()  # this buffer's previous send is done before it is refilled
            hashes = pack(slot, t)
        sums.extend(piece_sum(t.index, i, h) for i, h in enumerate(hashes))
        flight.add(functools.partial(group.send, buffers[slot][: t.size], t.dst, t.index))
    flight.drain()
    return b"".join(sums)
