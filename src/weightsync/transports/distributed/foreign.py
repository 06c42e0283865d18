"""Receiving the streams foreign trainers send: no manifest, no handshake, no checksums.

vLLM's and SGLang's trainers broadcast tensor by tensor (or, packed, the tensors' bytes
concatenated into a few large broadcasts) with nothing but the request's metadata to say
how many bytes to expect.  Two streams are received here:

* **per tensor**: one broadcast per tensor, in the request's order, each received into
  exactly its declared size;
* **flat**: the tensors' bytes concatenated in order and cut into broadcasts that close
  after the tensor that takes them past ``flat_bucket_bytes`` (vLLM's packed stream, see
  :func:`flat_chunks`), or one broadcast of everything (SGLang's ``flattened_bucket``).

Every tensor is hashed as it arrives.  With the request's ``hashes`` (the xxh3-64 of each
tensor, in order, as the trainer holds it) the hashes are compared before the stream ends,
so a short send (stale bytes left where the missing ones should be) or any other
disagreement fails the update as ``checksum_mismatch`` (torn: the bytes were written)
instead of committing a version for bytes the trainer never sent.  Without them the reader
reports ``verified: false``, and so does the worker's state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from weightsync.core.errors import LoadFailed
from weightsync.core.values import TensorSpec

from ..hashing import tensor_hash
from ..sink import Target, torch_dtype
from .group import Group
from .layout import nbytes


def flat_chunks(specs: Sequence[TensorSpec], flat_bucket_bytes: int | None) -> list[list[TensorSpec]]:
    """The tensors of each flat broadcast, in order: vLLM's rule (a chunk closes after the
    tensor that takes it past ``flat_bucket_bytes``), or everything in one without a size."""
    if flat_bucket_bytes is None:
        return [list(specs)]
    chunks: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        chunks[-1].append(spec)
        size += nbytes(spec)
        if size > flat_bucket_bytes:
            chunks.append([])
            size = 0
    return [c for c in chunks if c]


def receive_per_tensor(group: Group, specs: Sequence[TensorSpec], target: Target) -> Iterator[str]:
    """Receive one broadcast per tensor into ``target``; yield each tensor's hash as it is in."""
    for spec in specs:
        t = target.buffer(spec, group.device)
        if t is None:
            t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=group.device)
        group.wait(group.broadcast(t))
        digest = tensor_hash(t)
        target.accept(spec, t, digest)
        yield digest


def receive_flat(
    group: Group, specs: Sequence[TensorSpec], target: Target, flat_bucket_bytes: int | None
) -> Iterator[str]:
    """Receive the flat stream into ``target``; yield each tensor's hash as it is unpacked."""
    for chunk in flat_chunks(specs, flat_bucket_bytes):
        buf = torch.empty(sum(nbytes(s) for s in chunk), dtype=torch.uint8, device=group.device)
        group.wait(group.broadcast(buf))
        offset = 0
        for spec in chunk:
            raw = buf[offset : offset + nbytes(spec)]
            offset += nbytes(spec)
            digest = tensor_hash(raw)
            target.accept(spec, raw.view(torch_dtype(spec.dtype)).reshape(spec.shape), digest)
            yield digest


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
