"""Copying a tensor's elements in the calling thread.

torch's ``copy_`` splits every CPU copy above 32 K elements across its OpenMP threads, and
an OpenMP region ends only when its slowest thread does.  While a weight stream runs, the
cores are busy with the stream itself (gloo's send and receive threads, hashing), so a
parallel copy waits for a thread that is not running: on two busy cores a 1 MB ``copy_``
was measured at 15-26 ms, against 0.06 ms as one thread's copy.  The channels copy the
bytes of a stream through numpy instead, which copies in the calling thread (any strides)
and releases the GIL while it does.  The trainer may import this module.
"""

from __future__ import annotations

import torch

# numpy has no bfloat16 or float8: copy through an integer view of the same item size.
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst``, element by element (any strides).  Same dtype, shape and
    CPU device: copied in this thread; anything else (a cast, a GPU tensor) by ``copy_``."""
    view = _SAME_SIZE.get(dst.element_size())
    if (
        view is None
        or dst.dtype != src.dtype
        or dst.shape != src.shape
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or dst.dtype.is_complex
        or dst.is_conj()
        or src.is_conj()
        or dst.is_neg()
        or src.is_neg()
    ):
        with torch.no_grad():
            dst.copy_(src)
        return
    import numpy as np

    np.copyto(dst.detach().view(view).numpy(), src.detach().view(view).numpy(), casting="no")
