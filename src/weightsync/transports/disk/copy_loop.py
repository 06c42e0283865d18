"""The copy loop: a checked checkpoint's tensors, read into a target.

Shards are read sequentially with bounded ``readinto`` calls (never a memory mapping: a
file truncated underneath a mapping kills the process with SIGBUS, a short read is just an
error).  Tensors whose engine weight has the same dtype and layout are read straight into
it; others go through one reusable buffer.  Every tensor's bytes are hashed (xxh3-64) as
they arrive — the target records these hashes — and compared with the manifest's
per-tensor hashes (or, for manifests without them, each file's xxh3-128 at the end of the
file), so a checkpoint rewritten between verification and copy is never committed: the
load fails with ``wrote=True`` and the worker becomes torn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import attrs
import torch
import xxhash

from weightsync.core.errors import InvalidRequest

from ..hashing import hasher
from ..sink import Target, torch_dtype
from .format import CHUNK, ShardHeader, TensorEntry, corrupt, read_exactly

if TYPE_CHECKING:
    from .checks import DiskCheckpoint


@attrs.define
class ReadMeter:
    """Time spent hashing while copying (the cost of the fused verification)."""

    hash_seconds: float = 0.0


def _typed(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    dtype = torch_dtype(entry.spec.dtype)
    if entry.nbytes == 0:
        return torch.empty(entry.spec.shape, dtype=dtype)
    return buffer.view(dtype).reshape(entry.spec.shape)


def _read_shard(
    ckpt: DiskCheckpoint, shard: ShardHeader, into: Callable[[TensorEntry], torch.Tensor], meter: ReadMeter
) -> Iterator[tuple[TensorEntry, torch.Tensor, str]]:
    """Read ``shard`` front to back; each tensor's bytes go into ``into(entry)`` (a
    contiguous tensor of its dtype and shape).  Yields ``(entry, tensor, xxh3-64 hex)``
    once the tensor's bytes are in and match the manifest; raises at the first mismatch."""
    expected = ckpt.manifest.tensors if ckpt.manifest is not None else None
    whole = xxhash.xxh3_128() if ckpt.manifest is not None and expected is None else None
    with ckpt.reopen(shard) as f:
        if whole is not None:
            head = f.read(shard.data_start)
            if len(head) != shard.data_start:
                raise corrupt(shard.path, "file shrank while it was read")
            whole.update(head)
        else:
            f.seek(shard.data_start)
        for entry in shard.tensors.values():  # file order, back to back
            tensor = into(entry)
            view = tensor.detach().reshape(-1).view(torch.uint8).numpy().data
            h = hasher()
            for at in range(0, entry.nbytes, CHUNK):
                part = view[at : at + CHUNK]
                if read_exactly(f, part) != len(part):
                    raise corrupt(shard.path, "file shrank while it was read")
                t0 = time.perf_counter()
                h.update(part)
                if whole is not None:
                    whole.update(part)
                meter.hash_seconds += time.perf_counter() - t0
            digest = h.hexdigest()
            if expected is not None and expected.get(entry.spec.name) != digest:
                raise InvalidRequest(
                    f"{shard.name}: tensor {entry.spec.name!r} differs from the manifest "
                    "(the file changed after it was verified)",
                    code="manifest_mismatch",
                )
            yield entry, tensor, digest
    if (
        whole is not None
        and ckpt.manifest is not None
        and ckpt.manifest.files[shard.name].xxh3_128 != whole.hexdigest()
    ):
        raise InvalidRequest(
            f"{shard.name}: contents differ from the manifest (the file changed after it was verified)",
            code="manifest_mismatch",
        )


def copy_into(ckpt: DiskCheckpoint, target: Target, meter: ReadMeter | None = None) -> Iterator[None]:
    """Read every tensor of ``ckpt`` into ``target``, shard by shard, stepping once per
    tensor: into the memory the target lends (the engine's own tensor, or a fresh one a pull
    target keeps), else through one reusable buffer.  Each tensor's xxh3-64, checked against
    the manifest as it was read, goes with it.

    Raises ``NotFound`` (``missing_shard``) or ``InvalidRequest`` (``corrupt_checkpoint``,
    ``manifest_mismatch``) when a file changed after validation, ``OSError`` on a read error.
    """
    meter = meter or ReadMeter()
    cpu = torch.device("cpu")
    spare = torch.empty(0, dtype=torch.uint8)

    def into(entry: TensorEntry) -> torch.Tensor:
        nonlocal spare
        lent = target.buffer(entry.spec, cpu)
        if lent is not None:
            return lent
        if spare.numel() < entry.nbytes:
            spare = torch.empty(entry.nbytes, dtype=torch.uint8)
        return _typed(spare[: entry.nbytes], entry)

    for shard in ckpt.shards:
        for entry, tensor, digest in _read_shard(ckpt, shard, into, meter):
            target.accept(entry.spec, tensor, digest)
            yield
