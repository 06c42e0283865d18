"""Receiving the streams foreign trainers send: no manifest, no handshake, no checksums.

vLLM's and SGLang's trainers broadcast tensor by tensor (or, packed, the tensors' bytes
concatenated into a few large broadcasts) with nothing but the request's metadata to say
how many bytes to expect.  Two streams are received here:

* **per tensor**: one broadcast per tensor, in the request's order, each received into
  exactly its declared size;
* **flat**: the tensors' bytes concatenated in order and cut into broadcasts that close
  after the tensor that takes them past ``flat_bucket_bytes`` (vLLM's packed stream, see
  :func:`~.layout.flat_chunks`), or one broadcast of everything (SGLang's ``flattened_bucket``).

Every tensor is hashed as it arrives.  With the request's ``hashes`` (the xxh3-64 of each
tensor, in order, as the trainer holds it) the hashes are compared before the stream ends,
so a short send (stale bytes left where the missing ones should be) or any other
disagreement fails the update as ``checksum_mismatch`` (torn: the bytes were written)
instead of committing a version for bytes the trainer never sent.  Without them the reader
reports ``verified: false``, and so does the worker's state.

On gloo these streams are received only through a helper process (a group joined with
``receiver: "process"``, :mod:`.receiver`): gloo aborts the process that posted a receive
when more bytes arrive than it asked for, and a foreign stream's sizes are only the
request's word.  The helper's bytes are handed to the target once each broadcast is in
(never received straight into the engine's memory), so a lie on the first tensor changes
nothing; each is copied into the engine's memory and hashed there in one pass
(:func:`hand_over`).  On an inline gloo group a foreign stream is refused before any collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator, Sequence

import torch

from weightsync.core.errors import InvalidRequest, LoadFailed
from weightsync.core.snapshot import TensorSpec
from weightsync.transports.copying import copy_hashed, copy_into
from weightsync.transports.distributed.drain import Progress
from weightsync.transports.distributed.group import Group
from weightsync.transports.distributed.layout import flat_chunks, nbytes
from weightsync.transports.distributed.receiver import ReceiverGroup
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.sink import Target, torch_dtype

_CPU = torch.device("cpu")  # where a helper process's bytes are


def check_receiver(group: Group | ReceiverGroup) -> Group | ReceiverGroup:
    """``group``, if a foreign stream may be received on it.  Raises ``InvalidRequest``
    (``unsafe_stream``) for a gloo group this process joined itself: a trainer that sends
    more bytes than declared would abort it."""
    if isinstance(group, Group) and group.backend == "gloo":
        raise InvalidRequest(
            f"group {group.name!r} was joined by the worker itself (receiver 'inline'): a per-tensor or "
            "flat stream, whose sizes only the request declares, is received on gloo only by a group "
            "joined with receiver 'process' (a trainer sending more bytes than declared would abort "
            "the worker); join the group with receiver 'process', or send weightsync's packed stream",
            code="unsafe_stream",
        )
    return group


def receive_per_tensor(
    group: Group | ReceiverGroup,
    specs: Sequence[TensorSpec],
    target: Target,
    in_target: set[str],
    progress: Progress,
) -> Generator[str, None, None]:
    """Receive one broadcast per tensor into ``target``; yield each tensor's hash as it is in.
    Through a helper the next broadcast is received while this one is copied out.
    ``in_target`` gets the names hashed in the memory the target lent, after the write;
    ``progress`` how many broadcasts were received, however the stream ends."""
    if isinstance(group, ReceiverGroup):
        with _through_helper(group, [nbytes(s) for s in specs], progress) as raws:
            for spec, raw in zip(specs, raws, strict=True):
                yield hand_over(target, spec, raw, _CPU, in_target)
        return
    for spec in specs:
        lent = target.buffer(spec, group.device)
        t = (
            lent
            if lent is not None
            else torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=group.device)
        )
        with progress.receiving():
            group.wait(group.broadcast(t))
        digest = tensor_hash(t)
        target.accept(spec, t, digest)
        if lent is not None:
            in_target.add(spec.name)
        yield digest


def receive_flat(
    group: Group | ReceiverGroup,
    specs: Sequence[TensorSpec],
    target: Target,
    flat_bucket_bytes: int | None,
    in_target: set[str],
    progress: Progress,
) -> Generator[str, None, None]:
    """Receive the flat stream into ``target``; yield each tensor's hash as it is unpacked.
    Through a helper the next broadcast is received while this one is unpacked."""
    chunks = flat_chunks(specs, flat_bucket_bytes)
    sizes = [sum(nbytes(s) for s in chunk) for chunk in chunks]
    with contextlib.ExitStack() as stack:
        if isinstance(group, ReceiverGroup):
            bufs: Iterator[torch.Tensor] = stack.enter_context(_through_helper(group, sizes, progress))
        else:
            bufs = (_broadcast(group, size, progress) for size in sizes)
        for chunk, buf in zip(chunks, bufs, strict=True):
            offset = 0
            for spec in chunk:
                yield hand_over(target, spec, buf[offset : offset + nbytes(spec)], buf.device, in_target)
                offset += nbytes(spec)


@contextlib.contextmanager
def _through_helper(
    group: ReceiverGroup, sizes: Sequence[int], progress: Progress
) -> Iterator[Iterator[torch.Tensor]]:
    """The helper's receives of ``sizes`` (:meth:`ReceiverGroup.receive_each`).  However they
    end, ``progress`` then says how many broadcasts were received (a stream stopped early
    lets those asked for land first) and whether the group broke."""
    first = group.asked
    try:
        with contextlib.closing(group.receive_each(sizes)) as raws:
            yield raws
    finally:
        progress.taken, progress.broken = group.asked - first, group.dead


def hand_over(
    target: Target,
    spec: TensorSpec,
    raw: torch.Tensor,
    device: torch.device,
    in_target: set[str] | None = None,
) -> str:
    """Give ``target`` ``spec``'s bytes, ``raw`` (a slice of a received buffer), and return
    their xxh3-64: copied into the memory the target lends and hashed there in the same pass
    (:func:`~weightsync.transports.copying.copy_hashed`; ``in_target`` then gets the name),
    else hashed and handed over as they are (the target copies them)."""
    t = raw.view(torch_dtype(spec.dtype)).reshape(spec.shape)
    dst = target.buffer(spec, device)
    if dst is None:
        digest = tensor_hash(t)
        target.accept(spec, t, digest)
        return digest
    copied = copy_hashed(dst, t)
    if copied is None:  # not on the CPU: hash, then copy
        copied = tensor_hash(t)
        copy_into(dst, t)
    elif in_target is not None:
        in_target.add(spec.name)
    target.accept(spec, dst, copied)
    return copied


def _broadcast(group: Group, size: int, progress: Progress) -> torch.Tensor:
    """Rank 0's next broadcast of ``size`` bytes, received into fresh memory."""
    buf = torch.empty(size, dtype=torch.uint8, device=group.device)
    with progress.receiving():
        group.wait(group.broadcast(buf))
    return buf


def check_hashes(specs: Sequence[TensorSpec], received: Sequence[str], expected: Sequence[str]) -> None:
    """Compare what arrived with the trainer's hashes.  Raises ``LoadFailed``
    (``checksum_mismatch``, ``wrote=True``: the bytes are in the engine) when they differ."""
    bad = [s.name for s, got, want in zip(specs, received, expected, strict=True) if got != want]
    if bad:
        raise LoadFailed(
            f"the bytes received differ from the trainer's hashes: {len(bad)} tensor(s) fail their "
            f"xxh3-64 checksum, e.g. {bad[:5]} (a short or wrong send); the weights are torn",
            wrote=True,
            code="checksum_mismatch",
        )
