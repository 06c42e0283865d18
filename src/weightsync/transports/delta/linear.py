"""The linear digest: a per-tensor fingerprint that a delta updates in O(changed elements).

Why: a worker that takes a delta must check that what it now holds is the target the trainer
claims, without a pass over the bytes the delta left alone.  xxh3 (the per-tensor hash the
digest is built from) cannot be updated in place, so beside it a delta carries, per tensor,
this *linear* digest of the base and of the target.  Being linear in the tensor's words, it
changes by ``sum(coef(j) * (new_j - old_j))`` over the words ``j`` that changed: the worker
computes that change from the old words it reads before writing and the new words it reads
back after, and commits only when it equals ``target - base``.

The scheme (``weightsync-linear/1``), exact and documented so any trainer can compute it:

* a tensor's raw bytes are read as *words*: 16-bit little-endian unsigned integers for dtypes
  of two or more bytes, bytes for one-byte dtypes; word ``j`` of a tensor with ``n`` words;
* two lanes, each modulo the prime ``P = 2**31 - 1``; word ``j`` has coefficient
  ``ROW[lane][j % 4096] * chunk(lane, j // 4096) mod P``, where ``ROW`` comes from BLAKE2b of
  ``b"weightsync-linear/1" + lane + i`` and ``chunk`` is a fixed integer mixer (below);
* the digest is ``[sum_j coef(j) * word_j mod P for each lane]``.

For a fixed nonzero change the chance that both lanes miss it is about 2**-60 (coefficients
behave as random), so equal digests mean equal bytes against every accident: a corrupt or
truncated payload, an index off by one, a worker whose memory is not the base.  It is not a
MAC: whoever writes the manifest can choose claims; that is why the trainer computes the
target's digest from the target itself, never from the delta.
"""

from __future__ import annotations

import hashlib
from typing import Final

import torch

SCHEME: Final = "weightsync-linear/1"
P: Final = (1 << 31) - 1
ROW_LEN: Final = 4096
LANES: Final = 2
_CHUNK_STEP: Final = 1 << 20  # words per step of a full pass (bounded temporaries)
_MIX: Final = ((1_103_515_245, 12_345), (2_147_483_629, 7_919), (1_664_525, 1_013_904_223))


def _row(lane: int) -> torch.Tensor:
    values = []
    for i in range(ROW_LEN):
        h = hashlib.blake2b(f"{SCHEME}/{lane}/{i}".encode(), digest_size=8).digest()
        values.append(int.from_bytes(h, "little") % (P - 1) + 1)  # never 0
    return torch.tensor(values, dtype=torch.int64)


ROWS: Final = torch.stack([_row(lane) for lane in range(LANES)])  # (LANES, ROW_LEN)


def _mod(x: torch.Tensor) -> torch.Tensor:
    """``x mod P`` for int64 ``0 <= x < 2**63`` with shifts and masks (``P`` is a Mersenne
    prime; torch's ``%`` on int64 is a division, tens of times slower)."""
    x = (x & P) + (x >> 31)
    x = (x & P) + (x >> 31)
    return torch.where(x >= P, x - P, x)


def chunk_coefficients(chunks: torch.Tensor, lane: int) -> torch.Tensor:
    """``chunk(lane, k)`` for each chunk index ``k`` of ``chunks`` (int64, ``0 <= k < 2**40``):
    three rounds of an affine map modulo ``P`` with an xor-shift between them, never 0."""
    x = _mod(chunks + lane * 0x5BD1E995)
    for i, (a, b) in enumerate(_MIX):
        x = _mod(x * a + b + lane)
        if i < len(_MIX) - 1:
            x = x ^ (x >> (16 - 3 * i))
    return torch.where(x == 0, torch.ones_like(x), x)


def words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as its words (see the module), as a flat int64 tensor (a copy)."""
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    flat = t.reshape(-1)
    if flat.element_size() == 1:
        return flat.view(torch.uint8).to(torch.int64)
    return flat.view(torch.int16).to(torch.int64) & 0xFFFF


def words_per_element(dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return 1 if size == 1 else size // 2


def coefficients(positions: torch.Tensor) -> torch.Tensor:
    """``coef(j)`` of each word position ``j`` (int64): shape ``(LANES, len(positions))``."""
    rows = ROWS[:, positions & (ROW_LEN - 1)]
    # Changed words cluster in few chunks (sorted positions): mix each chunk's index once.
    chunks, inverse = torch.unique_consecutive(positions >> 12, return_inverse=True)  # // ROW_LEN
    return torch.stack(
        [_mod(rows[lane] * chunk_coefficients(chunks, lane)[inverse]) for lane in range(LANES)]
    )


def tensor_digest(tensor: torch.Tensor) -> list[int]:
    """The linear digest of ``tensor`` (a full pass over its bytes, in bounded steps)."""
    w = words(tensor)
    total = [0] * LANES
    for start in range(0, w.numel(), _CHUNK_STEP):
        part = w[start : start + _CHUNK_STEP]
        n = part.numel()
        first = start // ROW_LEN
        full = n - n % ROW_LEN
        for lane in range(LANES):
            acc = 0
            if full:
                sums = _mod((part[:full].view(-1, ROW_LEN) * ROWS[lane]).sum(1))
                ks = torch.arange(first, first + full // ROW_LEN, dtype=torch.int64)
                acc += int(_mod(sums * chunk_coefficients(ks, lane)).sum())
            if full < n:
                tail = torch.arange(start + full, start + n, dtype=torch.int64)
                acc += int(_mod(part[full:] * coefficients(tail)[lane]).sum())
            total[lane] = (total[lane] + acc) % P
    return total


def change(positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> list[int]:
    """How the linear digest moves when the words at ``positions`` (int64, word indices) go
    from ``old`` to ``new`` (int64 word values): O(len(positions))."""
    if positions.numel() == 0:
        return [0] * LANES
    diff = new - old + P  # in (P - 2**16, P + 2**16): positive, and the same modulo P
    coef = coefficients(positions)
    return [int(_mod(coef[lane] * diff).sum()) % P for lane in range(LANES)]


def changes(
    segments: torch.Tensor, positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor, count: int
) -> list[list[int]]:
    """:func:`change` of ``count`` tensors at once: word ``i`` (at ``positions[i]`` of tensor
    ``segments[i]``) goes from ``old[i]`` to ``new[i]``; returns each tensor's change.  One
    pass of vectorised work however many tensors there are (per-tensor calls cost a fixed
    overhead each, which dominates when few elements changed)."""
    out = torch.zeros((LANES, count), dtype=torch.int64)
    if positions.numel():
        diff = new - old + P
        coef = coefficients(positions)
        for lane in range(LANES):  # each term < P: a sum of fewer than 2**32 terms fits int64
            out[lane].index_add_(0, segments, _mod(coef[lane] * diff))
    return _mod(out).t().tolist()  # type: ignore[no-any-return]


def element_words(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The word positions and word values of ``values`` (one element each) at the element
    ``indices`` of a tensor of ``values``'s dtype."""
    per = words_per_element(values.dtype)
    positions = (indices.to(torch.int64).unsqueeze(1) * per + torch.arange(per, dtype=torch.int64)).reshape(
        -1
    )
    return positions, words(values)


def moved(base: list[int], target: list[int]) -> list[int]:
    """The change a delta from ``base`` to ``target`` must make."""
    return [(t - b) % P for b, t in zip(base, target, strict=True)]
