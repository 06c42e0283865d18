"""Copying a tensor's elements in the calling thread.

torch's ``copy_`` splits every CPU copy above 32 K elements across its OpenMP threads, and
an OpenMP region ends only when its slowest thread does.  While a weight stream runs, the
cores are busy with the stream itself (gloo's send and receive threads, hashing), so a
parallel copy waits for a thread that is not running: on two busy cores a 1 MB ``copy_``
was measured at 15-26 ms, against 0.06 ms as one thread's copy.  The channels copy the
bytes of a stream through numpy instead, which copies in the calling thread (any strides)
and releases the GIL while it does.  The trainer may import this module.

A received tensor is also hashed: :func:`copy_hashed` hashes each chunk just after it is
copied, while it is in cache, so the bytes cross memory once instead of twice.
"""

from __future__ import annotations

from typing import Final

import torch

from weightsync.transports.hashing import hasher, tensor_digest

HASHED_CHUNK: Final = 512 << 10
"""Bytes copied, then hashed, at a time by :func:`copy_hashed`: the source, the copy and the
hash's reads stay in a core's L2 cache."""
# numpy has no bfloat16 or float8: copy through an integer view of the same item size.
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _plain_pair(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src``'s bytes are ``dst``'s to be: same dtype and shape, both on the CPU,
    neither a lazy conjugate or negation view."""
    return (
        dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and not (dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg())
    )


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst``, element by element (any strides).  Same dtype, shape and
    CPU device: copied in this thread; anything else (a cast, a GPU tensor) by ``copy_``."""
    view = _SAME_SIZE.get(dst.element_size())
    if view is None or dst.dtype.is_complex or not _plain_pair(dst, src):
        with torch.no_grad():
            dst.copy_(src)
        return
    import numpy as np

    np.copyto(dst.detach().view(view).numpy(), src.detach().view(view).numpy(), casting="no")


def copy_hashed(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    """Copy ``src`` into ``dst`` in this thread, a chunk at a time, hashing each chunk of
    ``dst`` just after it is written; return the xxh3-64 of the bytes (:func:`~weightsync.
    transports.hashing.tensor_hash` of ``dst``).  ``None``, and nothing copied, unless both are
    contiguous CPU tensors of the same dtype and shape."""
    if not (_plain_pair(dst, src) and dst.is_contiguous() and src.is_contiguous()):
        return None
    import numpy as np

    out = dst.detach().reshape(-1).view(torch.uint8).numpy()
    into = src.detach().reshape(-1).view(torch.uint8).numpy()
    h = hasher()
    for start in range(0, out.size, HASHED_CHUNK):
        part = out[start : start + HASHED_CHUNK]
        np.copyto(part, into[start : start + HASHED_CHUNK], casting="no")
        h.update(part.data)
    return h.hexdigest()


def pack_digest(dst: torch.Tensor, src: torch.Tensor) -> bytes:
    """Pack ``src``'s bytes into ``dst`` (a ``uint8`` slice of a send buffer, as long as
    ``src`` is in bytes) and return their 8-byte xxh3-64
    (:func:`~weightsync.transports.hashing.tensor_digest` of ``src``): in one pass
    (:func:`copy_hashed`) when both are on the CPU, else copied, then hashed in ``dst``."""
    raw = src.detach().reshape(-1).view(torch.uint8)
    hexed = copy_hashed(dst, raw)
    if hexed is not None:
        return bytes.fromhex(hexed)
    copy_into(dst, raw)
    return tensor_digest(dst)
