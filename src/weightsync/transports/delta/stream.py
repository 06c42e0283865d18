"""The delta stream: a sparse delta received over a weight-update group, checked, then applied
all or nothing (:class:`~weightsync.core.sources.DeltaStreamSource`).

Two wire shapes:

* ``sparse``: vLLM's ``sparse_nccl`` (``vllm/distributed/weight_transfer/sparse_nccl_engine.py``,
  ``SparseNCCLWeightTransferEngine.receive_weights``): for each tensor in order, one broadcast
  of ``counts[i]`` int32 flat indices, then one of ``counts[i]`` values of the tensor's dtype.
  Its sizes are only the request's word, so on gloo it is received only by a group joined with
  ``receiver: "process"`` (:mod:`weightsync.transports.distributed.receiver`: a longer send
  kills the helper, not the worker; a send 8 or more bytes short is ``short_send``);
* ``packed``: weightsync's trainer (:mod:`weightsync.trainer.delta_push`): the same bytes (per
  tensor, its indices as int32 — int64 past 2**31 elements — then its values) concatenated and
  cut into broadcasts of ``bucket_bytes``.  The trainer posts ``(total, bucket_bytes)`` in the
  group's store first and every worker waits for rank 0's go (the packed stream's handshake),
  so a worker that refuses the base aborts the stream before any collective.

Everything is received before a byte is written; then checked (:func:`~.apply.prepare`: counts,
indices inside the tensor and unique — vLLM may send them unsorted, so they are sorted with
their values — dtypes, no NaN); then applied (:func:`~.apply.apply`: undone on any failure,
torn only when the undo cannot be proven).  A stream that breaks or falls short ends with
nothing written; the group is dropped when it is out of step.

The *claims* (the ``delta`` object's fields beside ``counts``, ``stream``, ``stream_id``):
``base`` (``{"digest", "version"?}``: the worker must hold exactly it, else ``409
base_mismatch``), and together ``target_hashes`` (xxh3-64 per tensor), ``base_linear`` and
``target_linear`` (the linear digests, :mod:`.linear`).  With them the write is verified in
O(changed elements) and the worker's digest is at once the target's.  The packed stream requires
them; vLLM's trainer sends none: the worker then checks only that what it wrote reads back as
what it received, rehashes every changed tensor in full (a pass over the bytes of each tensor
the delta touches: O(their size), not O(changed elements)) so that its digest stays true, and
reports ``verified: false`` — nothing the trainer claimed was checked.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import attrs
import torch

from weightsync.core.errors import InvalidRequest, LoadFailed, WeightSyncError
from weightsync.core.snapshot import TensorSpec
from weightsync.core.sources import DeltaStreamSource
from weightsync.core.validation import Body, array_of, obj
from weightsync.transports.delta import linear
from weightsync.transports.delta.apply import apply, prepare
from weightsync.transports.delta.manifest import Point, TensorDelta, _hash16, _linear, bad_delta
from weightsync.transports.delta.reader import base_mismatch
from weightsync.transports.distributed import foreign, packed
from weightsync.transports.distributed.group import Group
from weightsync.transports.distributed.keys import manifest_key
from weightsync.transports.distributed.receiver import ReceiverGroup
from weightsync.transports.distributed.worker import GroupRegistry
from weightsync.transports.hashing import tensor_hash
from weightsync.transports.sink import Target, check_metadata, torch_dtype

CLAIMS: Final = ("base", "target", "target_hashes", "base_linear", "target_linear")
LISTS: Final = ("target_hashes", "base_linear", "target_linear")


def index_dtype(numel: int) -> torch.dtype:
    """The packed stream's index dtype for a tensor of ``numel`` elements."""
    return torch.int32 if numel < 2**31 else torch.int64


def packed_sizes(tensors: Sequence[TensorSpec], counts: Sequence[int]) -> list[tuple[int, int]]:
    """Bytes of the indices and of the values of each tensor on the packed stream."""
    out = []
    for spec, n in zip(tensors, counts, strict=True):
        numel = _numel(spec)
        out.append((n * index_dtype(numel).itemsize, n * torch_dtype(spec.dtype).itemsize))
    return out


def packed_manifest(total: int, bucket_bytes: int) -> bytes:
    """What the trainer posts under ``manifest_key(stream_id)`` before the packed stream."""
    return struct.pack("<QQ", total, bucket_bytes)


def split_packed(
    buf: torch.Tensor, tensors: Sequence[TensorSpec], sizes: Sequence[tuple[int, int]]
) -> list[dict[str, torch.Tensor]]:
    """The packed stream's bytes ``buf`` (host memory, exactly ``sizes``' total) as each
    tensor's sorted indices and values (:func:`_sorted`)."""
    parts, at = [], 0
    for spec, (ni, nv) in zip(tensors, sizes, strict=True):
        idx = _typed(buf[at : at + ni], index_dtype(_numel(spec)))
        values = _typed(buf[at + ni : at + ni + nv], torch_dtype(spec.dtype))
        parts.append(_sorted(spec.name, idx, values))
        at += ni + nv
    return parts


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``raw`` (a slice of the stream) as ``dtype``: a section follows sections of
    other element sizes (int32 indices after bfloat16 values), so where its offset is not a
    multiple of the element size it is copied to aligned memory first."""
    size = dtype.itemsize
    return (raw if raw.storage_offset() % size == 0 else raw.clone()).view(dtype)


def _numel(spec: TensorSpec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n


def parse_claims(source: DeltaStreamSource) -> dict[str, Any]:
    """The source's claims, checked: ``base`` a :class:`~.manifest.Point` (or ``None``), the
    lists one entry per tensor (all three or none).  Raises ``InvalidRequest`` (``bad_delta``)."""
    b = Body(dict(source.claims), CLAIMS)
    out: dict[str, Any] = {"base": None, "base_version": False}
    if b.has("base"):
        out["base"] = Point.parse("delta.base", b.get("base", obj))
        out["base_version"] = "version" in source.claims["base"]
    if b.has("target"):
        out["target"] = Point.parse("delta.target", b.get("target", obj))
    given = [k for k in LISTS if b.has(k)]
    if given and len(given) != len(LISTS):
        raise bad_delta(f"delta.{', delta.'.join(LISTS)} are given together or not at all")
    check = {"target_hashes": _hash16, "base_linear": _linear, "target_linear": _linear}
    for key in given:
        values = b.get(key, array_of(check[key]))
        if len(values) != len(source.tensors):
            raise bad_delta(f"delta.{key} must have one entry per name ({len(source.tensors)})")
        out[key] = values
    if source.stream == "packed" and (out["base"] is None or not given):
        raise bad_delta(
            "the packed delta stream names its base and its target (delta.base, delta.target_hashes, "
            "delta.base_linear, delta.target_linear)"
        )
    return out


class DeltaStreamReader:
    """The reader of a :class:`~weightsync.core.sources.DeltaStreamSource` (see the module)."""

    kind = DeltaStreamSource.kind

    def __init__(self, registry: GroupRegistry, source: DeltaStreamSource) -> None:
        self.registry = registry
        self.source = source
        self._group: Group | Any = None
        self._claims: dict[str, Any] = {}
        self._figures: dict[str, Any] = {}

    @property
    def verified(self) -> bool:
        return "target_hashes" in self._claims

    def validate(self, specs: Mapping[str, TensorSpec]) -> dict[str, str] | None:
        """Everything checked before any collective (see the module).  Returns the hashes the
        load writes when the trainer claimed them."""
        src = self.source
        try:
            self._claims = claims = parse_claims(src)
        except InvalidRequest as exc:
            raise exc if exc.code == "bad_delta" else bad_delta(exc.message) from None
        check_metadata(src.tensors, specs, allow_partial=True)
        for spec, n in zip(src.tensors, src.counts, strict=True):
            if n > _numel(spec):
                raise bad_delta(f"{spec.name}: {n} changed elements of {_numel(spec)}", tensor=spec.name)
        if claims["base"] is not None:
            self._check_base(claims["base"], claims["base_version"])
        group = self.registry.get_any(src.group_name)
        self._group = (
            self.registry.get(src.group_name) if src.stream == "packed" else foreign.check_receiver(group)
        )
        if not self.verified:
            return None
        return {t.name: h for t, h in zip(src.tensors, claims["target_hashes"], strict=True)}

    def _check_base(self, base: Point, with_version: bool) -> None:
        held = self.source.held
        if held is None or held.digest is None:
            raise base_mismatch("the digest of the weights it holds is unknown", base_digest=base.digest)
        if held.digest != base.digest:
            raise base_mismatch(
                f"it holds digest {held.digest}, the delta applies to {base.digest}",
                held_digest=held.digest,
                base_digest=base.digest,
            )
        if with_version and held.declared and held.version != base.version:
            raise base_mismatch(
                f"it serves version {held.version!r}, the delta applies to {base.version!r}",
                base_digest=base.digest,
            )

    def stream(self, target: Target) -> Iterator[None]:
        src, group = self.source, self._group
        t0 = time.perf_counter()
        try:
            parts = self._packed(group) if src.stream == "packed" else self._sparse(group)
        except WeightSyncError:
            if isinstance(group, ReceiverGroup) and group.dead:
                self.registry._drop(group)
            raise
        except Exception as exc:  # nothing was written: the stream broke before the first write
            self.registry._drop(group)
            raise LoadFailed(
                f"delta stream on group {src.group_name!r} broke: {exc}", wrote=False, code="stream_failed"
            ) from exc
        t1 = time.perf_counter()
        patches = prepare(self._entries(parts), {k: v for p in parts for k, v in p.items()}, "sparse")
        yield None
        served = {
            p.name: target.buffer(TensorSpec(p.name, p.entry.dtype, p.entry.shape), torch.device("cpu"))
            for p in patches
        }
        if any(t is None for t in served.values()):
            raise InvalidRequest("this engine cannot take a delta in place", code="not_supported")
        if not self.verified:
            patches = [attrs.evolve(p, claimed=False) for p in patches]  # checked against what was received
        t2 = time.perf_counter()
        checks = apply(patches, served, "sparse")  # type: ignore[arg-type]
        t3 = time.perf_counter()
        hashes = dict(zip((t.name for t in src.tensors), self._claims.get("target_hashes", ()), strict=False))
        for p in patches:
            tensor = served[p.name]
            assert tensor is not None
            target.accept(
                TensorSpec(p.name, p.entry.dtype, p.entry.shape),
                tensor,
                hashes[p.name] if self.verified else tensor_hash(tensor),
            )
        self._figures = {
            "stream": src.stream, "tensors_changed": len(patches), "elements_changed": sum(src.counts),
            "wire_bytes": sum(v.numel() * v.element_size() for p in parts for v in p.values()),
            "receive_s": t1 - t0, "apply_s": t3 - t2, "rehash_s": time.perf_counter() - t3,
            "checks": checks, "rehashed": not self.verified,
        }  # fmt: skip
        yield None

    def _sparse(self, group: Any) -> list[dict[str, torch.Tensor]]:
        """vLLM's shape: per tensor, the indices then the values (two broadcasts)."""
        parts = []
        for spec, n in zip(self.source.tensors, self.source.counts, strict=True):
            idx = _receive(group, 4 * n).view(torch.int32)
            values = _receive(group, n * torch_dtype(spec.dtype).itemsize).view(torch_dtype(spec.dtype))
            parts.append(_sorted(spec.name, idx, values))
        return parts

    def _packed(self, group: Group) -> list[dict[str, torch.Tensor]]:
        src = self.source
        assert src.stream_id is not None
        sizes = packed_sizes(src.tensors, src.counts)
        total = sum(a + b for a, b in sizes)
        key = manifest_key(src.stream_id)
        theirs = group.store.get(key) if group.store.check([key]) else b""
        if (
            len(theirs) != 16
            or struct.unpack("<QQ", theirs)[0] != total
            or struct.unpack("<QQ", theirs)[1] < 1
        ):
            raise InvalidRequest(
                f"the trainer's delta stream {src.stream_id!r} is not {total} bytes as the "
                "request declares (or has no manifest in the group's store)",
                code="stream_mismatch",
            )
        bucket = struct.unpack("<QQ", theirs)[1]
        packed.handshake(group, src.stream_id)
        buf = torch.empty(total, dtype=torch.uint8, device=group.device)
        for start in range(0, total, bucket):
            group.wait(group.broadcast(buf[start : start + bucket]))
        return split_packed(buf.cpu(), src.tensors, sizes)

    def _entries(self, parts: list[dict[str, torch.Tensor]]) -> list[TensorDelta]:
        """One manifest entry per tensor with a change (without claims, no linear claim yet:
        the write is then checked against the values received)."""
        src, c = self.source, self._claims
        zero = (0,) * linear.LANES
        hashes = c.get("target_hashes", [""] * len(src.tensors))
        entries = []
        for i, (spec, n) in enumerate(zip(src.tensors, src.counts, strict=True)):
            if n:
                base, claimed = (
                    (c["base_linear"][i], c["target_linear"][i]) if self.verified else (zero, zero)
                )
                entries.append(
                    TensorDelta(
                        spec.name,
                        spec.dtype,
                        tuple(spec.shape),
                        n,
                        "",
                        hashes[i],
                        base,
                        claimed,
                        f"i:{spec.name}",
                        f"v:{spec.name}",
                    )
                )
        return entries

    def extra(self) -> dict[str, Any]:
        return {"verified": self.verified, "delta": self._figures}

    def close(self) -> None:
        """Nothing is held between validation and the stream."""


def _receive(group: Any, nbytes: int) -> torch.Tensor:
    """Rank 0's next broadcast of ``nbytes`` bytes, as a CPU tensor this reader owns."""
    if isinstance(group, ReceiverGroup):
        return group.receive(nbytes).clone()
    buf = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    group.wait(group.broadcast(buf))
    return buf.cpu()


def _sorted(name: str, idx: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """``idx`` and ``values`` in increasing index order (vLLM does not promise an order);
    a repeated index is refused (``bad_delta``): which value would win is undefined."""
    pos = idx.to(torch.int64)
    if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
        order = torch.argsort(pos, stable=True)
        idx, values = idx[order], values[order]
        pos = pos[order]
        if bool((pos[1:] == pos[:-1]).any()):
            raise bad_delta(f"{name}: an index is repeated", tensor=name)
    return {f"i:{name}": idx.contiguous(), f"v:{name}": values.contiguous()}
