"""Applying a delta to the served tensors: all or nothing, verified in O(changed elements).

:func:`prepare` checks a delta's payload against its manifest and writes nothing: indices of
an integer dtype, one dimension, exactly ``changed`` of them, strictly increasing, inside the
tensor; values of the tensor's dtype and count, never NaN.  :func:`apply` then

1. reads the old elements at every changed position of every tensor and computes the new
   ones (``xor`` needs the old to know the new), refusing NaN — still nothing written;
2. writes tensor after tensor, checking each by one xxh3 pass over it against the target's
   hash where that is cheaper (a dense change on the CPU, :data:`REHASH_BYTES_PER_CHANGED`),
   then checks the others all at once by the linear digest's change over their changed
   positions (old words to read-back words) against each claim ``target_linear -
   base_linear`` — one vectorised pass, whatever the number of tensors;
3. on any failure (a claim that does not match, an exception, a fault injected by a test)
   puts back the old elements it saved, in reverse order, and reads them back: when every
   byte it wrote is proven restored it raises :class:`~weightsync.transports.failures.Undone`
   (the worker is exactly on its base), else it re-raises (the worker is torn).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

import attrs
import torch

from weightsync.core.errors import InvalidRequest
from weightsync.transports.delta import linear
from weightsync.transports.delta.manifest import TensorDelta, bad_delta
from weightsync.transports.failures import Undone
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.sink import torch_dtype

Fault = Callable[[str, str], None]
REHASH_BYTES_PER_CHANGED: Final = 2048
"""A changed tensor is verified by one xxh3 pass over all its bytes (checked against the
target's hash) when it has at most this many bytes per changed element, else by the linear
move of its changed words.  Measured on one CPU core: xxh3 runs at about 20 GB/s (0.05 ns a
byte, in cache or not) while the batched linear move costs 80-140 ns per changed element, so
the two break even near 2 KB per changed element (about 0.2 % of float32 elements changed,
0.1 % of bfloat16); on an accelerator the linear move always is the cheaper check (hashing
there would mean copying every byte to the host)."""
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (raw bits, for exact comparison)."""
    return t.view(_BITS[t.element_size()])


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


@attrs.frozen
class Patch:
    """One tensor's checked change: sorted element ``indices`` (int64) and ``values``;
    ``claimed``: the entry's target hash and linear digest are the trainer's claims (else the
    write is checked only against the values received)."""

    entry: TensorDelta
    indices: torch.Tensor
    values: torch.Tensor
    claimed: bool = True

    @property
    def name(self) -> str:
        return self.entry.name


def _check_indices(entry: TensorDelta, indices: torch.Tensor) -> torch.Tensor:
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise bad_delta(f"{entry.name}: indices must be a 1-D int32 or int64 tensor", tensor=entry.name)
    if indices.numel() != entry.changed:
        raise bad_delta(
            f"{entry.name}: {indices.numel()} indices for {entry.changed} changed elements", tensor=entry.name
        )
    idx = indices.to(torch.int64)
    if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= entry.numel):
        raise bad_delta(f"{entry.name}: an index is outside 0..{entry.numel - 1}", tensor=entry.name)
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise bad_delta(
            f"{entry.name}: indices are not strictly increasing (unsorted or repeated)", tensor=entry.name
        )
    return idx


def prepare(
    entries: Sequence[TensorDelta], payload: Mapping[str, torch.Tensor], encoding: str
) -> list[Patch]:
    """The checked patches of ``entries`` (their payload tensors looked up by key).  Raises
    ``InvalidRequest`` (``bad_delta``); writes nothing."""
    patches = []
    for entry in entries:
        assert entry.indices is not None and entry.values is not None
        if entry.indices not in payload or entry.values not in payload:
            raise bad_delta(f"{entry.name}: the payload lacks its indices or values", tensor=entry.name)
        idx = _check_indices(entry, payload[entry.indices])
        values = payload[entry.values].reshape(-1) if payload[entry.values].dim() <= 1 else None
        dtype = torch_dtype(entry.dtype)
        if values is None or values.dtype != dtype or values.numel() != entry.changed:
            raise bad_delta(
                f"{entry.name}: values must be {entry.changed} elements of {entry.dtype}", tensor=entry.name
            )
        if encoding == "sparse" and _floating(dtype) and bool(torch.isnan(values).any()):
            raise bad_delta(f"{entry.name}: a new value is NaN", tensor=entry.name)
        patches.append(Patch(entry, idx, values.contiguous()))
    return patches


def _new_values(patch: Patch, old: torch.Tensor, encoding: str) -> torch.Tensor:
    if encoding == "sparse":
        return patch.values
    new = torch.bitwise_xor(bits(old), bits(patch.values)).view(old.dtype)
    if _floating(new.dtype) and bool(torch.isnan(new).any()):
        raise bad_delta(f"{patch.name}: the xor makes a NaN", tensor=patch.name)
    return new


def _restore(written: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], fault: Fault | None) -> bool:
    """Put the saved old elements back (last written first) and prove it by reading back."""
    try:
        with torch.no_grad():
            for flat, idx, old in reversed(written):
                if fault is not None:
                    fault("undo", "")
                flat[idx] = old
        return all(torch.equal(bits(flat[idx]), bits(old)) for flat, idx, old in written)
    except Exception:
        return False


def _rehash_is_cheaper(flat: torch.Tensor, changed: int) -> bool:
    """Whether one xxh3 pass over the whole tensor costs less than the linear move of its
    changed words (see :data:`REHASH_BYTES_PER_CHANGED`); never for memory off the CPU."""
    return (
        flat.device.type == "cpu" and flat.numel() * flat.element_size() <= REHASH_BYTES_PER_CHANGED * changed
    )


def _verify(p: Patch, flat: torch.Tensor, idx: torch.Tensor, new: torch.Tensor) -> str | None:
    """Check the tensor ``p`` just wrote where that is done at once (``rehash``, ``read_back``);
    ``None``: it is left to the linear check of every such tensor together (:func:`_linear`)."""
    if p.claimed and not _rehash_is_cheaper(flat, p.entry.changed):
        return None
    if not p.claimed:
        how, ok = "read_back", torch.equal(bits(flat[idx].cpu()), bits(new.cpu()))
    else:
        how, ok = "rehash", tensor_hash(flat) == p.entry.target_hash
    if not ok:
        raise _unverified(p, how)
    return how


def _unverified(p: Patch, how: str) -> InvalidRequest:
    return InvalidRequest(
        f"{p.name}: the weights after the delta are not the target it claims ({how})",
        code="delta_unverified",
        tensor=p.name,
    )


Pending = tuple[Patch, torch.Tensor, torch.Tensor, torch.Tensor]  # patch, flat, indices, old elements


def _linear(pending: Sequence[Pending]) -> int:
    """The linear check of every ``pending`` tensor at once: the move of the linear digest over
    its changed words (the old elements to those read back now) against its claim, ``target -
    base``.  Batched by dtype into one vectorised pass, so a delta of many tensors with few
    changes each pays no per-tensor overhead.  Returns how many it verified."""
    if not pending:
        return 0
    groups: dict[torch.dtype, list[int]] = {}
    for i, (_, _, _, old) in enumerate(pending):
        groups.setdefault(old.dtype, []).append(i)
    segments, positions, old_words, new_words = [], [], [], []
    for dtype, members in groups.items():
        idx = torch.cat([pending[i][2].cpu() for i in members])
        back = torch.cat([pending[i][1][pending[i][2]].cpu() for i in members])
        old = torch.cat([pending[i][3].cpu() for i in members])
        counts = torch.tensor([pending[i][2].numel() * linear.words_per_element(dtype) for i in members])
        where, words = linear.element_words(idx, old)
        segments.append(torch.repeat_interleave(torch.tensor(members, dtype=torch.int64), counts))
        positions.append(where)
        old_words.append(words)
        new_words.append(linear.words(back))
    cat = torch.cat
    got = linear.changes(cat(segments), cat(positions), cat(old_words), cat(new_words), len(pending))
    for (p, *_), lanes in zip(pending, got, strict=True):
        if lanes != linear.moved(list(p.entry.base_linear), list(p.entry.target_linear)):
            raise _unverified(p, "linear")
    return len(pending)


def apply(
    patches: Sequence[Patch], targets: Mapping[str, torch.Tensor], encoding: str, fault: Fault | None = None
) -> dict[str, int]:
    """Apply ``patches`` to the served ``targets`` (flat, contiguous views of each are taken),
    verified tensor by tensor; see the module for what a failure leaves.  Returns how many
    tensors each check verified."""
    flats = {}
    for p in patches:
        t = targets[p.name]
        if not t.is_contiguous():
            raise InvalidRequest(f"{p.name}: the served tensor is not contiguous", code="not_supported")
        flats[p.name] = t.view(-1)
    try:  # the served tensors are in hand (lent), but nothing is written yet
        with torch.no_grad():
            olds = [flats[p.name][p.indices.to(flats[p.name].device)] for p in patches]
            news = [_new_values(p, old.cpu(), encoding) for p, old in zip(patches, olds, strict=True)]
    except Exception as exc:
        raise Undone(exc, 0) from exc
    written: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    checks = {"linear": 0, "rehash": 0, "read_back": 0}
    pending: list[Pending] = []
    try:
        for p, old, new in zip(patches, olds, news, strict=True):
            flat = flats[p.name]
            idx = p.indices.to(flat.device)
            with torch.no_grad():
                written.append((flat, idx, old))
                flat[idx] = new.to(flat.device)
            if fault is not None:
                fault("wrote", p.name)
            how = _verify(p, flat, idx, new)
            if how is None:
                pending.append((p, flat, idx, old))
            else:
                checks[how] += 1
        checks["linear"] = _linear(pending)
    except BaseException as exc:
        if written and _restore(written, fault):
            raise Undone(exc, len(written)) from exc
        raise
    return checks
